"""The HSDP example runs under torchrun as 2 nodes x 2 ranks on one machine."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_hsdp_example_trains_under_torchrun_with_4_bit_gradients_between_nodes():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         os.path.join(ROOT, "examples", "hsdp.py"), "--nodes", "2", "--steps", "6"],
        capture_output=True, text=True, timeout=170, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = [line for line in out.stdout.splitlines() if line.startswith("step   5")]
    assert last and "between nodes 4." in last[0] and "inside 32.00" in last[0]
