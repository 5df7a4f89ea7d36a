"""One run at a time in a run directory: a second ``qsdp train`` given the ``--out`` of a live
run is refused in one line naming the holder's host and pid, on every rank; a lock its holder
left behind (the process is gone) is taken over, from another host once its lease lapses; two
runs racing for it never both hold it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
import uuid

import pytest

from distributed import run_world
from qsdp.cli import main
from qsdp.train.args import TrainError
from qsdp.train import runlock
from qsdp.train.runlock import LOCK_FILE, RunLockError, acquire, holder_refusal, release

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _shell(outside_torchrun):
    pass


def _hold(out, taken, done, release_at_end, lease, setup):
    """A process that takes the lock of ``out``, says so, and waits (or dies holding it)."""
    restore = setup() if setup else None
    acquire(out, lease=lease)
    if restore:
        restore()
    taken.set()
    if release_at_end:
        done.wait(60)
        release(out)
    os._exit(0)


def _holder(out, release_at_end=True, lease=runlock.LEASE_S, setup=None):
    ctx = mp.get_context("fork")
    taken, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(out), taken, done, release_at_end, lease, setup))
    proc.start()
    assert taken.wait(30)
    return proc, done


def test_a_run_into_a_directory_a_live_run_holds_is_refused_naming_its_host_and_pid(tmp_path, tiny_corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    proc, done = _holder(out)
    try:
        rc = main(["train", "--data", tiny_corpus, "--out", str(out), "--steps", "2", "--no-progress"])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    finally:
        done.set()
        proc.join(30)
    assert rc == 2 and len(lines) == 1, lines
    assert f"is in use by another qsdp train run (pid {proc.pid} on host {socket.gethostname()!r}" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == []  # the holder gave it back; nothing else was written


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    proc, _ = _holder(tmp_path, release_at_end=False)  # dies holding it, as a crashed run
    proc.join(30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    assert holder_refusal(tmp_path) is None
    acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(tmp_path)


def _lock_on_every_rank(rank, world, out):
    from qsdp.train.loop import _lock_run_directory

    try:
        _lock_run_directory(out, rank)
    except TrainError as e:
        return str(e)
    return None


def test_every_rank_refuses_together_when_rank_0_finds_the_directory_held(tmp_path):
    proc, done = _holder(tmp_path)
    try:
        messages = run_world(_lock_on_every_rank, 2, str(tmp_path), timeout=60)
    finally:
        done.set()
        proc.join(30)
    assert all(m is not None and f"pid {proc.pid}" in m for m in messages)


def test_a_live_holder_of_the_same_torchrun_job_is_not_taken_over(tmp_path, monkeypatch):
    """Two runs of one job id (a fixed --rdzv-id such as $SLURM_JOB_ID in one allocation)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    proc, done = _holder(tmp_path)
    try:
        with pytest.raises(RunLockError, match=f"pid {proc.pid} on host"):
            acquire(tmp_path)
    finally:
        done.set()
        proc.join(30)


def test_a_lock_file_without_a_whole_record_is_taken_over_only_once_its_lease_lapses(tmp_path):
    """An empty lock is what a run leaves between creating the file and writing its record if
    the two are apart; a contender that took it over at once would run beside that run."""
    (tmp_path / LOCK_FILE).write_bytes(b"")
    start = time.monotonic()
    acquire(tmp_path, lease=1.0)
    assert time.monotonic() - start >= 1.0
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(tmp_path)


def _race(rank, world, out, barrier):
    """Acquire ``out`` at once with the other process: its staleness decided, both wait at the
    barrier before either takes the lock over. Returns whether this process holds the lock."""
    decide = runlock._stale

    def decided_then_wait(*args):
        stale = decide(*args)
        runlock._stale = decide  # only the first decision waits for the other process
        barrier.wait(20)
        return stale

    runlock._stale = decided_then_wait
    try:
        acquire(out, lease=2.0)
    except RunLockError:
        return False
    held = json.loads((runlock.Path(out) / LOCK_FILE).read_text())["pid"] == os.getpid()
    time.sleep(0.5)  # holds it while the other reads it
    return held


def _report(results, fn, rank, args):
    results.put(fn(rank, 2, *args))
    results.close()
    results.join_thread()  # delivered before the process ends
    os._exit(0)


def _two_processes(fn, *args):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_report, args=(results, fn, r, (*args, barrier))) for r in range(2)]
    for p in procs:
        p.start()
    out = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    return out


@pytest.mark.parametrize("round_", range(3))
def test_two_runs_that_both_find_the_holder_dead_never_both_hold_the_lock(tmp_path, round_):
    proc, _ = _holder(tmp_path, release_at_end=False)  # dies holding it
    proc.join(30)
    assert sorted(_two_processes(_race, str(tmp_path))) == [False, True]


def test_a_lock_a_killed_run_left_on_another_host_is_taken_over_once_its_lease_lapses(tmp_path):
    """A job killed by SIGKILL or preemption on host A, requeued on this host."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({
        "host": "node-a", "machine": "another machine", "pidns": "pid:[4026531836]", "pid": 4242, "start": 1,
        "job": "7", "since": "2026-01-01T00:00:00Z", "token": uuid.uuid4().hex, "lease_s": 1.0}))
    assert holder_refusal(tmp_path) is None  # the launcher leaves it to rank 0's acquire
    start = time.monotonic()
    acquire(tmp_path, lease=30.0)  # the holder's own lease decides
    assert 1.0 <= time.monotonic() - start < 10
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == socket.gethostname()
    release(tmp_path)


def _on_node_a():
    real = socket.gethostname
    socket.gethostname = lambda: "node-a"
    return lambda: setattr(socket, "gethostname", real)


def _in_another_pid_namespace():
    """A container sharing this host's name and boot id, with a PID namespace of its own: its
    process id means nothing here (none such here)."""
    real_getpid, real_ns = os.getpid, runlock._pid_namespace
    os.getpid = lambda: 4194301
    runlock._pid_namespace = lambda: "pid:[1]"

    def restore():
        os.getpid = real_getpid
    return restore


@pytest.mark.parametrize("setup", [_on_node_a, _in_another_pid_namespace], ids=["other-host", "other-pid-namespace"])
def test_a_live_holder_this_process_cannot_check_is_refused_while_it_renews_its_lease(tmp_path, setup):
    proc, done = _holder(tmp_path, lease=1.0, setup=setup)
    try:
        time.sleep(1.5)  # longer than the lease: only the holder's renewals keep it
        with pytest.raises(RunLockError, match="is in use by another qsdp train run"):
            acquire(tmp_path, lease=1.0)
    finally:
        done.set()
        proc.join(30)
