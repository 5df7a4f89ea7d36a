"""An error reaches the user's terminal whichever rank raised it, and a traceback is never lost:
it goes where the run's output goes (its --out), and onto the terminal when no file can hold it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import qsdp.cli as cli
from qsdp.cli import main
from qsdp.launch import free_port
from qsdp.train.launcher import root_cause

pytestmark = pytest.mark.timeout(120)

# Two ranks as torchrun starts them: each joins the job's process group (as `qsdp train` does),
# leaves it, and then rank 1 alone fails on a bad input.
_RANK = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    import qsdp.preset_table
    from qsdp.cli import main
    from qsdp.train.args import TrainArgs, TrainError
    from qsdp.train.runtime import init_process_group

    def job(argv):
        init_process_group(TrainArgs(device="cpu", backend="gloo", timeout_s=60))
        rank = dist.get_rank()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 1:
            raise TrainError("a file only rank 1 cannot read")
        return 0

    qsdp.preset_table.main = job
    sys.exit(main(["presets"]))
""")


def test_a_user_error_on_a_rank_other_than_local_rank_0_reaches_the_terminal_with_its_rank():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        ended = [(p.wait(timeout=90), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errors = [line for _, err in ended for line in err.splitlines() if line.startswith("qsdp: error:")]
    assert [code for code, _ in ended] == [0, 2]
    assert errors == ["qsdp: error: rank 1: a file only rank 1 cannot read"]


def _broken(argv):
    raise ZeroDivisionError("a bug no check foresaw")


def test_a_traceback_no_file_can_hold_reaches_the_terminal(tmp_path, capsys, monkeypatch):
    import tempfile

    import qsdp.preset_table

    monkeypatch.setattr(qsdp.preset_table, "main", _broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # mkstemp fails: no such directory
    assert main(["presets"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "qsdp: error: unexpected ZeroDivisionError: a bug no check foresaw"
    assert "Traceback (most recent call last)" in err and "in _broken" in err


def test_a_train_traceback_goes_into_its_out(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug no check foresaw")

    monkeypatch.setattr(cli, "run_training", broken)
    out = tmp_path / "run"
    out.mkdir()
    assert main(["train", "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"qsdp: error: unexpected ZeroDivisionError: a bug no check foresaw (traceback: {out / 'error.txt'})"]
    assert "in broken" in (out / "error.txt").read_text()


def test_a_worker_traceback_no_file_can_hold_reaches_the_terminal(tmp_path, capsys, monkeypatch):
    """The run directory cannot take error.txt (it is gone): the launcher's report carries the
    root cause's traceback, and the command prints it under its one line."""
    record = {"rank": 1, "time": 1.0, "type": "ZeroDivisionError", "message": "division by zero", "user": False,
              "secondary": False, "attempt": 0, "traceback": "Traceback ... ZeroDivisionError: division by zero\n"}
    (tmp_path / "rank1.attempt0.json").write_text(json.dumps(record))
    failure = root_cause(tmp_path, {}, str(tmp_path / "gone"))

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.setattr(cli, "run_training", fails)
    assert main(["train", "--out", str(tmp_path / "gone")]) == 1
    assert capsys.readouterr().err.splitlines() == ["qsdp: error: rank 1: ZeroDivisionError: division by zero",
                                                    "Traceback ... ZeroDivisionError: division by zero"]
