"""The two-line FSDP2 example runs under torchrun."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_two_line_example_trains_under_torchrun():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "fsdp2_two_lines.py"), "--steps", "6", "--preset", "qsdp"],
        capture_output=True, text=True, timeout=170, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step   5" in out.stdout and "weights" in out.stdout
