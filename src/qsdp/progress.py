"""A local worker's progress, as the launcher that started it sees it: marks the worker writes at
each stretch of its work, and its Python stack on demand.

:func:`qsdp.launch.launch_local` starts every worker with :func:`start` on a folder of its own
(the watch folder), where the worker writes three files, named by rank and attempt:

- ``rank{R}.attempt{A}.pid``: its pid and the start time of its process (``/proc``'s clock ticks
  since boot), so that a recycled pid is never taken for it;
- ``rank{R}.attempt{A}.progress``: a count and a word on what it does now, rewritten in place by
  :func:`mark` (one ``pwrite`` of a fixed-size record: no allocation, no fsync, no rename);
- ``rank{R}.attempt{A}.stack``: every thread's Python stack, written by :mod:`faulthandler` from
  its signal handler when the launcher sends :data:`STACK_SIGNAL`. The handler runs in C, so a
  worker stuck inside a C function (an OpenMP barrier, a lock, a collective) still writes it.

:class:`qsdp.progress_guard.ProgressGuard` reads them. Outside a local launch (under
``torchrun``, in a user's script) :func:`mark` does nothing.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
from pathlib import Path
from typing import IO

__all__ = ["STACK_SIGNAL", "GRACE_S", "FINISHED", "start", "started", "mark", "collective_timeout", "pid_path", "progress_path",
           "stack_path", "write_record", "read_pid", "read_progress", "process_state", "process_start", "cpu_seconds"]

# SIGUSR1 is taken by batch systems and frameworks (SLURM's and Lightning's requeue warning).
STACK_SIGNAL = signal.SIGUSR2
# What the guard adds to --timeout: its looks (at most a second apart), the stacks' dump, the kill.
# A guarded worker's collectives wait this much longer than --timeout, so that a peer waiting on a
# stuck rank does not time out first and take the blame.
GRACE_S = 10.0
FINISHED = "finished"  # the last mark of a worker whose job returned (it waits for the launch's end)
_RECORD = 120  # bytes of a progress record: "<count> <what>", padded with spaces

_state: dict[str, object] = {}


def pid_path(directory: str | Path, rank: int, attempt: int) -> Path:
    """Where a launched worker writes its pid and start time."""
    return Path(directory) / f"rank{rank}.attempt{attempt}.pid"


def progress_path(directory: str | Path, rank: int, attempt: int) -> Path:
    return Path(directory) / f"rank{rank}.attempt{attempt}.progress"


def stack_path(directory: str | Path, rank: int, attempt: int) -> Path:
    return Path(directory) / f"rank{rank}.attempt{attempt}.stack"


def start(directory: str | Path, rank: int, attempt: int) -> None:
    """In a worker of a local launch, before its job: its pid file, its first mark, and its stack
    dumped to :func:`stack_path` on :data:`STACK_SIGNAL`."""
    directory = Path(directory)
    stack: IO[str] = open(stack_path(directory, rank, attempt), "w", encoding="utf-8")  # noqa: SIM115 - the handler's
    stack.write(f"rank {rank}, pid {os.getpid()}, main thread {threading.main_thread().ident:#x}\n")
    stack.flush()
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True)
    fd = os.open(progress_path(directory, rank, attempt), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _state.update(fd=fd, count=0, stack=stack)
    mark("starting")
    tmp = pid_path(directory, rank, attempt).with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()} {process_start(os.getpid())}")
    tmp.replace(pid_path(directory, rank, attempt))  # complete when seen


def started() -> bool:
    """Whether this process is a worker of a local launch that watches its progress."""
    return "fd" in _state


def mark(what: str) -> None:
    """Record that this worker moved on to ``what`` (a few words: ``"step 12"``); nothing outside
    a watched local launch. A few microseconds: called a few times a step, never per collective."""
    fd = _state.get("fd")
    if fd is None:
        return
    count = _state["count"] = int(_state["count"]) + 1  # type: ignore[call-overload]
    record = f"{count} {what}".encode("utf-8", "replace")[:_RECORD].ljust(_RECORD)
    os.pwrite(fd, record, 0)  # type: ignore[arg-type]


def collective_timeout(timeout_s: float) -> float:
    """The seconds a collective of this worker may wait: ``timeout_s``, plus :data:`GRACE_S` in a
    watched local launch (the guard names a stuck rank first)."""
    return timeout_s + GRACE_S if started() else timeout_s


def write_record(path: Path, record: dict) -> None:
    """A launcher's failure record (JSON), whole when a reader sees it (written aside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(path)


def read_pid(path: Path) -> tuple[int, int | None] | None:
    """``(pid, start time)`` from a pid file (the start ``None`` in a file of a pid alone); ``None``
    while it is not written."""
    try:
        fields = path.read_text().split()
        return int(fields[0]), (int(fields[1]) if len(fields) > 1 and fields[1] != "None" else None)
    except (OSError, ValueError, IndexError):
        return None


def read_progress(path: Path) -> tuple[int, str] | None:
    """``(count, what)`` of a worker's last mark; ``None`` before the first."""
    try:
        count, _, what = path.read_bytes().decode("utf-8", "replace").strip().partition(" ")
        return int(count), what
    except (OSError, ValueError):
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``'T'``: stopped by a signal, ``'Z'``: exited, not reaped), or ``None``."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``None``: no such process, or no ``/proc``):
    with the pid, the identity of a process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds ``pid`` has used (``None``: no such process, or no ``/proc``)."""
    fields = _stat_fields(pid)
    if not fields or len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
