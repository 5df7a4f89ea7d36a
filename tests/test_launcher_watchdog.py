"""A local worker stopped by a signal (SIGSTOP) is found by the launcher within about the
collective timeout, named and killed; a worker that runs, however busy, is never taken for one.

The watch (:mod:`qsdp.watchdog`) runs on real processes here: children of the test, as
spawned workers are the launcher's, stopped or not; workers forked by the fork server, which
are not; and a real ``qsdp train --nproc 2`` whose rank 1 gets SIGSTOP from outside, as a user
(or a debugger) would send it. The launcher's death watch, which tells in which order workers
ended and how, on forked workers too.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from qsdp.train.metrics import read_metrics, read_summary
from qsdp.train.launcher import DeathWatch
from qsdp.progress import process_start
from qsdp.watchdog import STOP_SIGNAL, StoppedWorkerWatch, pid_path, stopped_by

pytestmark = pytest.mark.skipif(not hasattr(os, "waitid"), reason="needs waitid (POSIX)")

def _worker(directory: Path, rank: int) -> subprocess.Popen:
    """A child (it sleeps: running or not is what counts), with its pid where a launched worker
    of ``rank`` writes it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid_path(directory, rank, 0).write_text(str(child.pid))
    return child


def _stop(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while stopped_by(child.pid) is None and time.monotonic() < deadline:  # the kernel stops it at once, mostly
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_stopped_worker_is_killed_within_the_timeout_and_named(tmp_path):
    timeout = 1.0
    child = _worker(tmp_path, 3)
    with StoppedWorkerWatch(tmp_path, timeout) as watch:
        stopped = time.monotonic()
        _stop(child)
        assert child.wait(timeout=30) == -signal.SIGKILL
        found = time.monotonic() - stopped
    # The timeout, plus at most two looks of the watch (and this machine's load).
    assert timeout < found < timeout + 2, found
    record = json.loads((tmp_path / "rank3.attempt0.stopped.json").read_text())
    assert watch.stopped == {(0, 3): record}
    assert (record["rank"], record["pid"], record["user"], record["secondary"]) == (3, child.pid, False, False)
    assert re.fullmatch(rf"rank 3 \(pid {child.pid} on host '[^']+'\) was stopped by SIGSTOP for [0-9.]+ s, longer "
                        r"than the timeout \(1 s, --timeout\): its peers' collectives could not complete; the "
                        r"launcher killed it", record["message"]), record["message"]


@pytest.mark.timeout(60)
def test_a_worker_that_runs_or_is_stopped_for_less_than_the_timeout_is_left_alone(tmp_path):
    timeout = 1.0
    running, paused = _worker(tmp_path, 0), _worker(tmp_path, 1)
    try:
        with StoppedWorkerWatch(tmp_path, timeout) as watch:
            _stop(paused)
            time.sleep(timeout / 2)
            os.kill(paused.pid, signal.SIGCONT)
            time.sleep(2 * timeout)
            assert watch.stopped == {}
        assert running.poll() is None and paused.poll() is None
    finally:
        for child in (running, paused):
            child.kill()
            child.wait()


@pytest.mark.timeout(60)
def test_a_look_that_comes_late_starts_the_count_again(tmp_path):
    """The launcher stopped with its workers (Ctrl-Z on the job) and continued: its workers'
    time stopped before then is not counted, though one of them is still stopped at its first look."""
    timeout = 1.0
    child = _worker(tmp_path, 0)
    try:
        _stop(child)
        watch = StoppedWorkerWatch(tmp_path, timeout)
        watch.look()
        time.sleep(1.5 * timeout)  # the launcher did not look for longer than the timeout
        late = time.time()
        watch.look()
        assert watch.stopped == {} and child.poll() is None
        while not watch.stopped and time.time() - late < 5 * timeout:
            time.sleep(0.2 * timeout)
            watch.look()
        # Killed, counted from the late look.
        assert list(watch.stopped) == [(0, 0)] and child.wait(timeout=30) == -signal.SIGKILL
        assert watch.stopped[(0, 0)]["time"] >= late
        assert time.time() - late > timeout
    finally:
        child.kill()
        child.wait()


def _forked(directory: Path, rank: int) -> multiprocessing.Process:
    """A worker as a forking launch starts one: the fork server's child, not this process's
    (it sleeps), with its pid where a launched worker of ``rank`` writes it."""
    worker = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    worker.start()
    pid_path(directory, rank, 0).write_text(str(worker.pid))
    with pytest.raises(ChildProcessError):
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return worker


@pytest.mark.timeout(60)
def test_a_forked_worker_stopped_by_a_signal_is_seen_stopped_though_not_the_launchers_child(tmp_path):
    worker = _forked(tmp_path, 0)
    try:
        assert stopped_by(worker.pid) is None
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while stopped_by(worker.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped_by(worker.pid) == STOP_SIGNAL  # which signal, only its parent could tell
        os.kill(worker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while stopped_by(worker.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped_by(worker.pid) is None
    finally:
        worker.kill()
        worker.join()


@pytest.mark.skipif(not DeathWatch.sees_forked_workers(), reason="needs pidfd_open (Linux 5.3)")
@pytest.mark.timeout(60)
def test_the_death_watch_sees_in_which_order_and_how_forked_workers_ended(tmp_path):
    """Rank 1 is killed first, rank 0 after it: the launcher's death watch has both, in that
    order, with their signals, though neither is its child (the order is what names the root
    cause of a failed run, :func:`qsdp.train.launcher.root_cause`)."""
    rank0, rank1 = _forked(tmp_path, 0), _forked(tmp_path, 1)
    try:
        with DeathWatch(tmp_path) as watch:
            deadline = time.monotonic() + 10
            while len(watch._watched) < 2 and time.monotonic() < deadline:  # noqa: SLF001 - both pids read
                time.sleep(0.01)
            os.kill(rank1.pid, signal.SIGKILL)
            while (0, 1) not in watch.deaths and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(rank0.pid, signal.SIGTERM)
            while (0, 0) not in watch.deaths and time.monotonic() < deadline:
                time.sleep(0.01)
            rank1.join()  # as the elastic agent joins its workers
            rank0.join()
    finally:
        for worker in (rank0, rank1):
            worker.kill()
            worker.join()
    (first, killed, code1), (second, termed, code0) = watch.deaths[(0, 1)], watch.deaths[(0, 0)]
    assert (killed, code1, termed, code0) == ("SIGKILL", None, "SIGTERM", None)
    assert first < second


# ---------------------------------------------------------------------------------------------
# Through the real command line


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


def _stop_rank_1_after(steps: int, out: Path, launcher_files: Path) -> tuple[threading.Thread, dict]:
    """A thread that sends SIGSTOP to rank 1's first worker once ``steps`` steps are logged in
    ``out``; the dict gets its pid and the time (monotonic) of the stop."""
    stop: dict[str, float | int] = {}

    def run() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            time.sleep(0.1)
            try:  # files being written read as not there yet
                if len(read_metrics(out)) < steps:
                    continue
                pid = int(next(launcher_files.glob("qsdp-errors-*")).joinpath(pid_path("", 1, 0)).read_text())
            except (OSError, ValueError, StopIteration):
                continue
            os.kill(pid, signal.SIGSTOP)
            stop.update(pid=pid, at=time.monotonic())
            return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, stop


def _train_argv(corpus: str, out: Path, *more: str) -> list[str]:
    return ["train", "--preset", "sdp4bit", "--nproc", "2", "--batch-size", "4", "--seq-len", "32", "--data", corpus,
            "--out", str(out), "--eval-every", "0", "--eval-batches", "2", "--no-progress", *more]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_stopped_with_sigstop_ends_the_run_within_the_timeout_naming_its_rank(tmp_path, corpus, capsys,
                                                                                      monkeypatch):
    """Rank 1 of `qsdp train --nproc 2 --timeout 10` gets SIGSTOP after step 2: the run ends
    (exit 1) about the timeout later with one line naming rank 1 and its pid. It took the
    timeout plus the elastic agent's 30 s wait for a SIGTERM the stopped process never acted
    on, and named rank 0, whose collective timed out."""
    from qsdp.cli import main

    timeout = 10
    out = tmp_path / "run"
    # The launcher's own files (each worker's pid among them) go to a temporary directory: this one.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stopper, stop = _stop_rank_1_after(2, out, tmp_path)
    assert main(_train_argv(corpus, out, "--steps", "100", "--timeout", str(timeout))) == 1
    ended = time.monotonic()
    stopper.join()
    assert stop, "rank 1's worker was not found"
    assert ended - stop["at"] < timeout + 5, ended - stop["at"]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qsdp:")]
    assert len(lines) == 1, lines
    # A forked worker is the fork server's child: the launcher sees that it is stopped, not by which signal.
    assert re.fullmatch(rf"qsdp: error: rank 1 \(pid {stop['pid']} on host '[^']+'\) was stopped by "
                        rf"(SIGSTOP|{STOP_SIGNAL}) for "
                        r"[0-9.]+ s, longer than the timeout \(10 s, --timeout\): its peers' collectives could not "
                        r"complete; the launcher killed it", lines[0]), lines[0]
    assert not Path(f"/proc/{stop['pid']}").exists()  # killed and reaped, nothing left behind


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_stopped_with_sigstop_is_restarted_under_max_restarts_as_after_a_crash(tmp_path, corpus,
                                                                                        monkeypatch):
    """With `--max-restarts 1` and a checkpoint every 2 steps, rank 1 stopped after step 3: the
    group restarts from step 2 and the run ends done, every step logged."""
    from qsdp.cli import main

    out = tmp_path / "run"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stopper, stop = _stop_rank_1_after(3, out, tmp_path)
    assert main(_train_argv(corpus, out, "--steps", "8", "--ckpt-every", "2", "--max-restarts", "1",
                            "--timeout", "10")) == 0
    stopper.join()
    assert stop, "rank 1's worker was not found"
    summary = read_summary(out)
    assert (summary["restarts"], summary["start_step"], summary["steps"]) == (1, 2, 8)
    assert not Path(f"/proc/{stop['pid']}").exists()


# ---------------------------------------------------------------------------------------------
# The watches' own failures


@pytest.mark.skipif(not DeathWatch.sees_forked_workers(), reason="needs pidfd_open (Linux 5.3)")
@pytest.mark.timeout(60)
def test_the_death_watch_works_with_descriptors_numbered_past_1024(tmp_path):
    """A launcher used as a library by a process with many files open: the worker's pidfd gets a
    number select() refuses; the watch still sees how the worker ended (select raised ValueError,
    and the final look replaced the run's result with it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the open-file limit cannot reach 1200 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        child = _worker(tmp_path, 0)
        with DeathWatch(tmp_path) as watch:
            deadline = time.monotonic() + 10
            while not watch._watched and time.monotonic() < deadline:  # noqa: SLF001 - its pidfd opened
                time.sleep(0.01)
            assert max(fd for _, fd in watch._watched.values()) >= 1024  # noqa: SLF001
            child.kill()
            while (0, 0) not in watch.deaths and time.monotonic() < deadline:
                time.sleep(0.01)
            child.wait()
        assert watch.deaths[(0, 0)][1] == "SIGKILL"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_forked_workers_are_watched_only_where_the_system_answers_pidfd_open(monkeypatch):
    """The probe asks the system once: where a seccomp filter refuses pidfd_open (ENOSYS or
    EPERM), the launcher spawns its workers instead of forking ones it could not watch."""
    import errno

    def refused(pid, flags=0):
        raise OSError(errno.ENOSYS, "Function not implemented")

    DeathWatch.sees_forked_workers.cache_clear()
    monkeypatch.setattr(os, "pidfd_open", refused)
    try:
        assert DeathWatch.sees_forked_workers() is False
    finally:
        monkeypatch.undo()
        DeathWatch.sees_forked_workers.cache_clear()
    assert DeathWatch.sees_forked_workers() is True


@pytest.mark.timeout(60)
def test_a_stopped_process_named_by_an_earlier_attempts_pid_file_is_left_alone(tmp_path):
    """Attempt 0's worker has ended and its pid now names an unrelated stopped process; attempt 1
    runs. The stopped-worker watch leaves that process alone and removes attempt 0's file."""
    unrelated = _worker(tmp_path, 1)  # attempt 0's pid file, rank 1, names it
    current = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid_path(tmp_path, 1, 1).write_text(f"{current.pid} {process_start(current.pid)}")
    try:
        _stop(unrelated)
        with StoppedWorkerWatch(tmp_path, 0.5) as watch:
            time.sleep(2.0)
        assert watch.stopped == {}
        assert stopped_by(unrelated.pid) is not None  # still there, still stopped
        assert not pid_path(tmp_path, 1, 0).exists()
    finally:
        for child in (unrelated, current):
            child.kill()
            child.wait()


@pytest.mark.timeout(60)
def test_a_pid_that_names_another_process_than_the_worker_that_wrote_it_is_never_signalled(tmp_path):
    """A pid file records the worker's start time with its pid: a stopped process that took the
    pid since (its start time differs) is not the worker, and is not killed."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid_path(tmp_path, 0, 0).write_text(f"{other.pid} {process_start(other.pid) - 1}")
    try:
        _stop(other)
        with StoppedWorkerWatch(tmp_path, 0.5) as watch:
            time.sleep(2.0)
        assert watch.stopped == {} and stopped_by(other.pid) is not None
    finally:
        other.kill()
        other.wait()


_WATCH_WITHOUT_KILL = """
import json, sys, time
from qsdp.watchdog import StoppedWorkerWatch
with StoppedWorkerWatch(sys.argv[1], 0.5) as watch:
    time.sleep(2.5)
    alive = watch._thread.is_alive()
print(json.dumps({"alive": alive, "stopped": len(watch.stopped)}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv: the watch runs without the capability to signal other users")
@pytest.mark.timeout(60)
def test_a_worker_the_launcher_may_not_kill_is_reported_and_the_watch_goes_on(tmp_path):
    """The stopped worker belongs to user nobody and the watch runs without CAP_KILL: os.kill is
    refused. The watch thread survives (it died of the PermissionError), and the record says so."""
    worker = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    pid_path(tmp_path, 0, 0).write_text(f"{worker.pid} {process_start(worker.pid)}")
    try:
        _stop(worker)
        result = subprocess.run(["setpriv", "--bounding-set=-kill", sys.executable, "-c", _WATCH_WITHOUT_KILL,
                                 str(tmp_path)], capture_output=True, text=True, timeout=40)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"alive": True, "stopped": 0}
        record = json.loads((tmp_path / "rank0.attempt0.stopped.json").read_text())
        assert record["message"].endswith("the launcher was not allowed to kill it")
        assert stopped_by(worker.pid) is not None
    finally:
        worker.kill()
        worker.wait()
