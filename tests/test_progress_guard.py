"""A local worker that makes no progress for the timeout, wherever it is stuck, ends the job: the
stuck rank and the ranks that waited for it are named in one line, with what each was doing, and
every rank's Python stack is kept (qsdp.progress_guard, qsdp.progress).

The real command line (`qsdp train`), a bare local launch as the benchmarks make, and the guard's
reading of the stacks faulthandler writes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qsdp import progress
from qsdp.progress_guard import main_thread_frames, waiting_in_collective

QSDP = str(Path(sys.executable).with_name("qsdp"))
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "QSDP_TEST_KILL_AT", "QSDP_TEST_STALL_AT", "QSDP_TEST_HOLD_AT",
         "PYTEST_CURRENT_TEST")


def _train(tmp_path_factory, corpus: str, out: Path, timeout: int, **faults: str) -> tuple[subprocess.CompletedProcess, float]:
    """`qsdp train --nproc 2 --timeout T` with a fault; its result and wall time."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env |= {"QSDP_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "qsdp-cache"), **faults}
    argv = [QSDP, "train", "--no-progress", "--model", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--eval-every", "0", "--data", corpus, "--out", str(out), "--nproc", "2",
            "--steps", "4", "--timeout", str(timeout)]
    started = time.monotonic()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=200)
    return result, time.monotonic() - started


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("qsdp: error")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def _waited(line: str) -> float:
    return float(re.search(r"the job waited ([0-9.]+) s", line).group(1))


@pytest.mark.timeout(240)
def test_a_rank_held_before_its_first_step_is_named_within_the_timeout(tmp_path_factory, tmp_path, tiny_corpus):
    """Rank 1 blocks on a lock before step 1, outside any collective (as a deadlocked worker
    does); rank 0 waits in its first gather. The job ends (exit 1) after the timeout, naming
    rank 1 and where it was, and rank 0 as the one that waited; both stacks are in --out."""
    timeout, out = 8, tmp_path / "run"
    result, wall = _train(tmp_path_factory, tiny_corpus, out, timeout, QSDP_TEST_HOLD_AT="1:1")
    assert result.returncode == 1
    line = _error_line(result)
    assert re.match(r"qsdp: error: rank 1 \(pid \d+ on host '[^']+'\) made no progress and the job waited "
                    rf"[0-9.]+ s, longer than the timeout \({timeout} s, --timeout\): at 'step 1', in hold "
                    r"\(faults\.py:\d+\); rank 0 waited for it at 'step 1', in ", line), line
    assert timeout <= _waited(line) < timeout + progress.GRACE_S
    assert wall < 120  # start-up, the timeout and the grace: never the hold's forever
    assert "in hold" in (out / "stack-rank1.txt").read_text()
    assert "train_step" in (out / "stack-rank0.txt").read_text()


@pytest.mark.timeout(240)
def test_a_rank_that_stops_answering_is_named_not_the_rank_that_waited(tmp_path_factory, tmp_path, tiny_corpus):
    """Rank 0 sleeps 120 s before step 2 while rank 1 waits for it in a collective: the guard
    names rank 0, the sleeper (its peer's collective timeout would have named rank 1)."""
    timeout, out = 8, tmp_path / "run"
    result, _ = _train(tmp_path_factory, tiny_corpus, out, timeout, QSDP_TEST_STALL_AT="2:0:120")
    assert result.returncode == 1
    line = _error_line(result)
    assert re.match(r"qsdp: error: rank 0 \(pid \d+ on host '[^']+'\) made no progress .* at 'step 2', in stall "
                    r"\(faults\.py:\d+\); rank 1 waited for it at 'step 2', in ", line), line
    assert _waited(line) < timeout + progress.GRACE_S


def _hold_on_rank_1(flag: str) -> int:
    """A benchmark's worker whose rank 1 blocks for good before any collective."""
    if os.environ["RANK"] == "1":
        held = threading.Lock()
        held.acquire()
        held.acquire()
    return 0


def _launch_elsewhere(call: str, timeout: float = 100) -> subprocess.CompletedProcess:
    """``call`` (a ``launch_local`` of this file's functions) in a process of its own, as a
    benchmark runs one; it prints what the launch returned or raised. Not in the test process:
    a launch that fails can leave the elastic agent's threads behind, and the kept worlds of
    tests/distributed.py are forked from the test process."""
    code = ("import json, sys, test_progress_guard as t\nfrom qsdp.launch import launch_local\n"
            f"try:\n    print(json.dumps({{'returned': {call}}}))\n"
            "except Exception as e:\n    print(json.dumps({'raised': type(e).__name__, 'message': str(e)}))\n")
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def _outcome(result: subprocess.CompletedProcess) -> dict:
    import json

    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_a_bare_local_launch_is_guarded_too_and_prints_the_stacks():
    """A launch as the benchmarks make it (no --out): StuckRankError naming rank 1 within the
    timeout and the grace, every rank's stack on standard error."""
    started = time.monotonic()
    result = _launch_elsewhere("{str(k): v for k, v in launch_local(t._hold_on_rank_1, 2, 'x', timeout_s=4).items()}")
    outcome = _outcome(result)
    assert outcome["raised"] == "StuckRankError", outcome
    assert re.match(r"rank 1 .* made no progress .*: at 'starting', in _hold_on_rank_1", outcome["message"]), outcome
    assert time.monotonic() - started < 4 + progress.GRACE_S + 60
    assert "qsdp: stack of rank 1:" in result.stderr and "_hold_on_rank_1" in result.stderr


def _wait_for_each_other(flag: str) -> int:
    """Both ranks wait in a receive from the other, which never sends (a collective that cannot
    complete): the process group's own timeout, 15 s, ends it."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank = dist.get_rank()
    dist.recv(torch.zeros(1), src=1 - rank)
    return rank


@pytest.mark.timeout(150)
def test_ranks_that_all_wait_in_a_collective_are_left_to_its_timeout():
    """Every rank waits in a collective (a slow link looks the same): the guard, at 3 s, ends
    nothing; the collective's own timeout does, as a failure of the ranks, not a stuck one."""
    started = time.monotonic()
    outcome = _outcome(_launch_elsewhere("launch_local(t._wait_for_each_other, 2, 'x', timeout_s=3)"))
    assert outcome["raised"] == "ChildFailedError", outcome
    assert time.monotonic() - started > 14


def test_a_line_waiting_on_a_collectives_handle_is_waiting_in_a_collective(tmp_path):
    source = tmp_path / "pipelined.py"
    source.write_text("def exchange(work):\n    work.wait()\n    return 1\n")
    assert waiting_in_collective([(str(source), 2, "exchange")])
    assert not waiting_in_collective([(str(source), 3, "exchange")])


def _busy(seconds: float) -> int:
    """A worker that computes for ``seconds`` without a mark (a long compile, a slow first step)."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    return 0


@pytest.mark.timeout(150)
def test_a_worker_that_keeps_a_core_busy_is_working_not_stuck():
    outcome = _outcome(_launch_elsewhere("{str(k): v for k, v in launch_local(t._busy, 1, 10.0, timeout_s=4).items()}"))
    assert outcome == {"returned": {"0": 0}}


_DUMP = """rank 1, pid 4242, main thread 0x7f00aa
Thread 0x00007f00bb (most recent call first):
  File "/x/threading.py", line 320 in wait

Current thread 0x00007f00aa (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/site/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 250 in foreach_all_gather
  File "/src/qsdp/train/trainer.py", line 300 in train_step
"""


def test_the_main_threads_frames_are_read_from_the_dump_innermost_first():
    frames = main_thread_frames(_DUMP)
    assert frames[0] == ("/site/torch/distributed/distributed_c10d.py", 4394, "all_gather_single")
    assert [f[2] for f in frames] == ["all_gather_single", "foreach_all_gather", "train_step"]
    assert waiting_in_collective(frames)


def test_a_rank_in_its_own_code_is_not_waiting_in_a_collective():
    dump = _DUMP.replace("distributed/distributed_c10d.py", "nn/modules/linear.py").replace(
        "fsdp/_fully_shard/_fsdp_collectives.py", "nn/modules/module.py")
    assert not waiting_in_collective(main_thread_frames(dump))
    assert main_thread_frames("no header here") == []


def test_marks_outside_a_watched_launch_do_nothing_and_collectives_keep_their_timeout():
    assert not progress.started()
    progress.mark("step 1")
    assert progress.collective_timeout(30.0) == 30.0
