"""The examples run as they are written: the two-line FSDP2 one under torchrun on 2 ranks (run
ahead of its test, tests/prestarted.py), then it and the HSDP one as 2 nodes x 2 ranks on one
machine, on workers of torch's elastic agent forked rather than started afresh (tests/scripts.py;
torchrun's command line is the first test's)."""

import os

import pytest
from prestarted import PRESTARTED, Command
from scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(180)


def _torchrun(nproc: int, script: str, *args: str) -> Command:
    # --standalone: a free port of its own, as it runs beside other tests' ranks.
    return Command.python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                          os.path.join(ROOT, "examples", script), *args, cwd=ROOT,
                          set_env={"OMP_NUM_THREADS": "1"})


def _example(script: str) -> str:
    return os.path.join(ROOT, "examples", script)


TWO_LINES_TORCHRUN = _torchrun(2, "fsdp2_two_lines.py", "--steps", "6", "--preset", "qsdp")


@pytest.mark.prestart(lambda: TWO_LINES_TORCHRUN)  # three fresh interpreters: run ahead
def test_two_line_example_on_one_machine_sends_nothing_between_nodes(request):
    rc, printed = PRESTARTED.result(request.node.nodeid, TWO_LINES_TORCHRUN, timeout=170)
    assert rc == 0, printed[-2000:]
    last = [line for line in printed.splitlines() if line.startswith("step   5")]
    assert last and "weights inter  0.00" in last[0] and "grads inter  0.00" in last[0]


def test_two_line_example_emulating_two_nodes_shows_4_bit_traffic_between_them():
    stdout = run_script(4, _example("fsdp2_two_lines.py"), "--steps", "6", "--preset", "sdp4bit", "--emulate-nodes", "2")
    last = [line for line in stdout.splitlines() if line.startswith("step   5")]
    assert last and "intra 32.00" in last[0] and "grads inter  4." in last[0], stdout
    weights_inter = float(last[0].split("weights inter")[1].split()[0])
    assert 4.0 < weights_inter < 8.0  # differences in 4 bits plus scales and padding, not 32


def test_hsdp_example_trains_on_2_nodes_x_2_ranks_with_4_bit_gradients_between_nodes():
    stdout = run_script(4, _example("hsdp.py"), "--nodes", "2", "--steps", "6")
    last = [line for line in stdout.splitlines() if line.startswith("step   5")]
    assert last and "between nodes 4." in last[0] and "inside 32.00" in last[0]


@pytest.mark.slow
def test_hsdp_example_on_fsdp2s_native_mesh_sends_4_bit_gradients_between_nodes():
    stdout = run_script(4, _example("hsdp.py"), "--nodes", "2", "--steps", "6", "--native")
    last = [line for line in stdout.splitlines() if line.startswith("step   5")]
    assert last and "between nodes 4." in last[0] and "inside 32.00" in last[0]
