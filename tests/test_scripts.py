"""A script run by tests/scripts.py sees what torchrun gives its workers, and a failing one fails."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from scripts import run_script

pytestmark = pytest.mark.timeout(60)

SHOW_ENVIRONMENT = """\
import os, sys
import torch
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
if __name__ == "__main__":
    print(os.environ["RANK"], all(os.environ.get(n) for n in names), sys.argv[1:], os.getcwd(), torch.get_num_threads())
"""


def test_each_worker_runs_the_script_as_main_with_its_arguments_rank_and_one_thread(tmp_path):
    (tmp_path / "show.py").write_text(SHOW_ENVIRONMENT, encoding="utf-8")
    printed = run_script(2, "show.py", "--steps", "3", cwd=str(tmp_path)).splitlines()
    assert printed == [f"{rank} True ['--steps', '3'] {tmp_path} 1" for rank in (0, 1)]


def test_a_script_exiting_with_an_error_status_fails_its_launch(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nprint('about to fail')\nsys.exit(3)\n", encoding="utf-8")
    with pytest.raises(ChildFailedError, match="exited with 3"):
        run_script(2, "fail.py", cwd=str(tmp_path))
