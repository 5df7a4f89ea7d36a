"""Finding a local worker that was stopped (SIGSTOP), within about the collective timeout, by rank.

A stopped rank answers no collective. Its peers only see a collective that times out, and the
elastic agent, told of their exit, sends it SIGTERM, which a stopped process never acts on: the
job then waited for the agent's own deadline (30 s) before its SIGKILL, and the error named the
peer whose collective timed out.

The launcher, not stopped itself, sees the stop: ``waitid(WSTOPPED | WNOWAIT)`` reports a child
stopped by a signal without taking the report from anyone; a worker forked by the fork server
(:mod:`qsdp.worker_start`) is that server's child, and its state in ``/proc`` says that it is
stopped (not by which signal).
:class:`StoppedWorkerWatch` looks at every worker ten times per timeout; a worker seen stopped
at every look for longer than the timeout gets a failure record (its rank, pid and host, and the
signal) where the workers write theirs, and is then killed with SIGKILL, which a stopped process
cannot ignore: the job ends, or restarts under ``--max-restarts``, as after a crash. A worker
that runs but makes no progress (a deadlock, a lock, a peer it waits for) is the progress guard's
(:mod:`qsdp.progress_guard`). Only the attempt that runs now is watched: the pid files of the
attempts before it are removed, and a pid whose process started at another time than the worker
that wrote it (a pid reused since) is never signalled.

A heartbeat from a thread of each worker was tried first and dropped: a worker's threads can all
be held for seconds while it runs (a live rank 0 went 5.7 s without a beat, under ``--timeout 5``
on a loaded machine, before its first step), so a missing beat does not tell a stopped rank from
a busy one. Only the local launcher can watch this way: under ``torchrun``, qsdp runs inside each
rank and no process of its own watches them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from qsdp.progress import pid_path, process_start, process_state, read_pid, write_record

__all__ = ["STOP_SIGNAL", "Poller", "StoppedWorkerWatch", "look_interval", "pid_path", "signal_name", "stopped_by",
           "worker_pid_files"]


def look_interval(timeout_s: float) -> float:
    """Seconds between two looks of the watch: ten per timeout, at most one a second."""
    return min(1.0, timeout_s / 10)


def worker_pid_files(directory: Path) -> Iterator[tuple[int, int, Path]]:
    """``(rank, attempt, path)`` of every pid file a worker wrote in ``directory`` (:func:`pid_path`)."""
    for path in directory.glob("rank*.attempt*.pid"):
        rank, attempt = (int(x) for x in path.name[4:-4].split(".attempt"))
        yield rank, attempt, path


def signal_name(number: int) -> str:
    """``'SIGSTOP'`` for its number; ``'signal N'`` for one Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Poller:
    """A daemon thread calling :meth:`look` every ``interval_s`` seconds while the ``with`` block
    runs (and once more after it, with ``final_look``)."""

    def __init__(self, interval_s: float, name: str, final_look: bool = False) -> None:
        self.interval_s, self._final_look = interval_s, final_look
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._final_look:
            self.look()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.look()

    def look(self) -> None:
        raise NotImplementedError


def _record_path(directory: Path, rank: int, attempt: int) -> Path:
    # Matches the launcher's ``rank*.json`` records; its own name, so a rank's record is never replaced.
    return directory / f"rank{rank}.attempt{attempt}.stopped.json"


# What a stopped process that is not this process's child is stopped by, as far as this process can
# tell: the kernel shows its state, not the signal (SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU).
STOP_SIGNAL = "a stop signal"


def stopped_by(pid: int) -> str | None:
    """The signal that keeps ``pid`` stopped now (``'SIGSTOP'``), or ``None``: running, exited,
    or no way to tell here. A child of this process says which signal (``waitid``); another
    process (a worker forked by :mod:`qsdp.worker_start`'s server) only that it is stopped,
    from ``/proc``: :data:`STOP_SIGNAL`."""
    if not hasattr(os, "waitid") or not hasattr(os, "WSTOPPED"):
        return None
    try:
        status = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return STOP_SIGNAL if process_state(pid) == "T" else None
    if status is None or status.si_code != os.CLD_STOPPED:
        return None
    return signal_name(status.si_status)


class StoppedWorkerWatch(Poller):
    """In the launcher, for the workers whose pid files are in ``directory``
    (``rank{R}.attempt{A}.pid``): a worker stopped by a signal at every look for longer than
    ``timeout_s`` gets a failure record naming it and is killed. Times are the launcher's own
    monotonic clock; a look that comes late (the launcher itself was stopped, as by Ctrl-Z on the
    job, and continued with its workers) starts every count again. ``stopped``:
    ``(attempt, rank) -> record`` of each worker it killed."""

    def __init__(self, directory: str | Path, timeout_s: float) -> None:
        super().__init__(look_interval(timeout_s), "qsdp-stopped-worker-watch")
        self.directory, self.timeout_s = Path(directory), timeout_s
        self.host = socket.gethostname()
        self.stopped: dict[tuple[int, int], dict[str, Any]] = {}
        self._since: dict[tuple[int, int], tuple[float, float]] = {}  # seen stopped since (monotonic, wall)
        self._last_look: float | None = None
        self._refused: set[tuple[int, int]] = set()  # workers the launcher may not signal

    def look(self) -> None:
        """One look at every worker of the latest attempt; the pid files of the attempts before it
        are removed (their workers have ended: a pid they name may be another process's by now)."""
        now, wall = time.monotonic(), time.time()
        if self._last_look is not None and now - self._last_look > self.timeout_s / 2:
            self._since.clear()  # this process did not run in between: what it saw before says nothing
        self._last_look = now
        files = list(worker_pid_files(self.directory))
        latest = max((attempt for _, attempt, _ in files), default=0)
        for rank, attempt, path in files:
            key = (attempt, rank)
            if attempt < latest:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            written = read_pid(path)
            if key in self.stopped or key in self._refused or written is None:  # not written yet
                continue
            pid, start = written
            if start is not None and process_start(pid) != start:  # ended; the pid may be reused
                self._since.pop(key, None)
                continue
            how = stopped_by(pid)
            if how is None:
                self._since.pop(key, None)
                continue
            since = self._since.setdefault(key, (now, wall))
            if now - since[0] > self.timeout_s:
                self._kill(rank, attempt, pid, how, now - since[0], since[1])

    def _kill(self, rank: int, attempt: int, pid: int, how: str, stopped_s: float, since: float) -> None:
        record = {
            "rank": rank, "attempt": attempt, "time": since, "type": "RankStopped", "user": False,
            "secondary": False, "stopped": True, "pid": pid, "host": self.host, "traceback": "",
            "message": (f"rank {rank} (pid {pid} on host {self.host!r}) was stopped by {how} for {stopped_s:.1f} s, "
                        f"longer than the timeout ({self.timeout_s:g} s, --timeout): its peers' collectives could not "
                        "complete; the launcher killed it"),
        }
        path = _record_path(self.directory, rank, attempt)
        # The record first: the job's end, which the kill starts, reports it.
        with contextlib.suppress(OSError):
            write_record(path, record)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's process: said, and the watch goes on with the others
            record["message"] = record["message"].replace("the launcher killed it",
                                                          "the launcher was not allowed to kill it")
            with contextlib.suppress(OSError):
                write_record(path, record)
            self._refused.add((attempt, rank))
            return
        self.stopped[(attempt, rank)] = record
