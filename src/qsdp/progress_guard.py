"""The launcher's guard against a local worker that stops making progress, wherever it is stuck.

A worker stuck outside any collective (a deadlock in its first ``fully_shard``, a lock, a sleep)
leaves no peer to time out: before this guard such a job waited forever, printing nothing. A
rank stuck while its peers wait in a collective was reported by the peers' collective timeout,
which named the rank that waited instead of the one it waited for.

Each worker marks its progress (:func:`qsdp.progress.mark`: at each stretch of a step, at a
checkpoint, at an evaluation). A rank makes progress when it writes a new mark, or while it keeps
a core busy, a tenth of it at least (a long compile, a slow first step: working, not stuck). A live rank
that does neither for longer than the timeout, and is not stopped by a signal (the stopped-worker
watch, :mod:`qsdp.watchdog`, names that), sets the guard off: it asks every rank for its Python
stack (:data:`qsdp.progress.STACK_SIGNAL`). The stuck ranks are those whose main thread is not
waiting in a collective; the guard names them and the ranks that waited, with what each was
doing, writes a failure record where the workers write theirs, and kills the attempt's workers.
Where every rank waits in a collective (a slow link, a peer lost inside one) it ends nothing:
each collective's own timeout bounds that wait. The job then ends, or restarts under ``--max-restarts``, as after a crash,
within the timeout plus :data:`qsdp.progress.GRACE_S`.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qsdp import progress
from qsdp.watchdog import Poller, look_interval, stopped_by

__all__ = ["ProgressGuard", "StuckRankError", "waiting_in_collective", "main_thread_frames"]

# CPU seconds per second of wall time that count as working: a rank blocked on a lock, a barrier
# or a collective uses next to none (a worker deadlocked in OpenMP: 1 s in 3 minutes), a working
# one most of a core, or a tenth of one on a machine shared with other jobs.
_BUSY_SHARE = 0.1
_STACK_WAIT_S = 3.0  # how long the guard waits for the stacks once asked

# The innermost Python frame of a rank blocked in a collective: one of torch's c10d calls (their
# wait is in C, below them), FSDP2's wait for its all-gather, or any line waiting on a collective's
# handle (``work.wait()``: qsdp's pipelined reduce-scatter, a user's async collective).
_COLLECTIVE_FILES = re.compile(r"torch/distributed/(distributed_c10d|c10d_logger)\.py$|"
                               r"torch/distributed/fsdp/_fully_shard/_fsdp_collectives\.py$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


class StuckRankError(RuntimeError):
    """A local launch ended by :class:`ProgressGuard`: the message names the stuck rank."""


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the main thread's frames, innermost first, from a worker's
    stack file (:func:`qsdp.progress.stack_path`: its header names the main thread, then
    :mod:`faulthandler`'s dumps; the last dump counts)."""
    header = re.match(r"rank \d+, pid \d+, main thread (0x[0-9a-f]+)", dump)
    if header is None:
        return []
    main = int(header.group(1), 16)
    frames: list[tuple[str, int, str]] = []
    current: list[tuple[str, int, str]] | None = None
    for line in dump.splitlines()[1:]:
        thread = re.match(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if thread is not None:
            current = [] if int(thread.group(1), 16) == main else None
            if current is not None:
                frames = current
            continue
        frame = _FRAME.match(line)
        if frame is not None and current is not None:
            current.append((frame["file"], int(frame["line"]), frame["func"]))
    return frames


def waiting_in_collective(frames: list[tuple[str, int, str]]) -> bool:
    """Whether the innermost frame is a collective's call or a wait on a collective's handle (its
    source line read from the file: the launcher runs on the workers' machine)."""
    if not frames:
        return False
    file, line, _ = frames[0]
    return bool(_COLLECTIVE_FILES.search(file.replace(os.sep, "/"))) or ".wait(" in linecache.getline(file, line)


def _where(frames: list[tuple[str, int, str]]) -> str:
    if not frames:
        return "no stack"
    file, line, func = frames[0]
    return f"{func} ({Path(file).name}:{line})"


@dataclass
class _Rank:
    pid: int
    start: int | None
    count: int = -1
    what: str = ""
    since: float = 0.0  # monotonic time of the last progress
    since_wall: float = 0.0
    cpu: float = 0.0  # CPU seconds at the last progress


class ProgressGuard(Poller):
    """In the launcher, over a launch's watch folder (:mod:`qsdp.progress`'s files): ends the
    attempt whose rank made no progress for ``timeout_s`` (see the module doc). ``stacks_to``: the
    folder that receives every rank's stack as ``stack-rank{R}.txt`` (``None``: standard error);
    ``what``: how the user set the timeout (an option's name). ``fired``: attempt -> the one line
    that named the stuck rank."""

    def __init__(self, directory: str | Path, timeout_s: float, stacks_to: str | Path | None = None,
                 what: str = "--timeout") -> None:
        super().__init__(look_interval(timeout_s), "qsdp-progress-guard")
        self.directory, self.timeout_s, self.what = Path(directory), timeout_s, what
        self.stacks_to = None if stacks_to is None else Path(stacks_to)
        self.host = socket.gethostname()
        self.fired: dict[int, str] = {}
        self._ranks: dict[tuple[int, int], _Rank] = {}
        self._last_look: float | None = None

    def look(self) -> None:
        now = time.monotonic()
        if self._last_look is not None and now - self._last_look > self.timeout_s / 2:
            self._ranks.clear()  # this process did not run in between (stopped itself): start again
        self._last_look = now
        attempt = self._read(now)
        if attempt is None or attempt in self.fired:
            return
        live = {rank: r for (a, rank), r in self._ranks.items() if a == attempt and _alive(r)}
        late = {rank for rank, r in live.items()
                if now - r.since > self.timeout_s and r.what != progress.FINISHED and stopped_by(r.pid) is None}
        if late:
            self._fire(attempt, live, late, now)

    def ended_last_attempt(self) -> str | None:
        """The line naming the stuck rank when the guard ended the launch's last attempt, else ``None``."""
        attempts = [int(path.name.split(".attempt")[1].split(".")[0]) for path in self.directory.glob("rank*.attempt*.pid")]
        last = max(attempts, default=None)
        return self.fired.get(last) if last is not None else None

    def _read(self, now: float) -> int | None:
        """Each worker's pid and progress; returns the latest attempt (``None``: none started)."""
        latest = None
        for path in self.directory.glob("rank*.attempt*.pid"):
            rank, attempt = (int(x) for x in path.name[4:-4].split(".attempt"))
            latest = attempt if latest is None else max(latest, attempt)
            key = (attempt, rank)
            if key not in self._ranks:
                pid = progress.read_pid(path)
                if pid is None:
                    continue
                self._ranks[key] = _Rank(pid[0], pid[1], since=now, since_wall=time.time(),
                                         cpu=progress.cpu_seconds(pid[0]) or 0.0)
            r = self._ranks[key]
            mark = progress.read_progress(progress.progress_path(self.directory, rank, attempt))
            cpu = progress.cpu_seconds(r.pid)
            if mark is not None and mark[0] != r.count:
                r.count, r.what = mark
                r.since, r.since_wall, r.cpu = now, time.time(), cpu or r.cpu
            elif cpu is not None and now - r.since >= 1.0 and cpu - r.cpu >= _BUSY_SHARE * (now - r.since):
                r.since, r.since_wall, r.cpu = now, time.time(), cpu  # working: a long stretch, not a hang
        return latest

    def _fire(self, attempt: int, live: dict[int, _Rank], late: set[int], now: float) -> None:
        dumps = self._stacks(attempt, live)
        frames = {rank: main_thread_frames(dump) for rank, dump in dumps.items()}
        # Whoever is not waiting in a collective holds the others, late or not (a rank that marked
        # its step later than its peers, then stalled, is not late yet when they are).
        working = {rank: r for rank, r in live.items() if r.what != progress.FINISHED}
        stuck = sorted(rank for rank in working if not waiting_in_collective(frames.get(rank, [])))
        if not stuck:
            # Every rank waits in a collective: a slow link, or a peer lost inside one. Each
            # collective's own timeout (--timeout plus the grace) bounds that wait and names it;
            # the guard is for ranks stuck outside them, and looks again a timeout later.
            for r in working.values():
                r.since, r.since_wall = now, time.time()
            return
        self._keep_stacks(dumps)
        waiting = sorted(set(live) - set(stuck))
        first = min((live[rank] for rank in stuck), key=lambda r: r.since)
        idle = max(now - live[rank].since for rank in late)
        doing = lambda rank: f"at '{live[rank].what}', in {_where(frames.get(rank, []))}"  # noqa: E731
        plural = "s" if len(stuck) > 1 else ""
        message = (f"rank{plural} {', '.join(map(str, stuck))} (pid{plural} "
                   f"{', '.join(str(live[r].pid) for r in stuck)} on host {self.host!r}) made no progress and the job "
                   f"waited {idle:.1f} s, longer than the timeout ({self.timeout_s:g} s, {self.what}): "
                   + "; ".join((f"rank {r} " if plural else "") + doing(r) for r in stuck))
        for r in waiting:
            message += f"; rank {r} waited for {'them' if plural else 'it'} {doing(r)}"
        message += f"; the launcher ended the job; every rank's stack: {self._stack_place()}"
        record = {
            "rank": stuck[0], "attempt": attempt, "time": first.since_wall, "type": "RankStuck", "user": False,
            "secondary": False, "stuck": True, "pid": first.pid, "host": self.host, "traceback": "", "message": message,
        }
        with contextlib.suppress(OSError):  # the record first: the job's end, which the kill starts, reports it
            progress.write_record(self.directory / f"rank{stuck[0]}.attempt{attempt}.stuck.json", record)
        self.fired[attempt] = message
        for rank in [*stuck, *waiting]:
            _signal(live[rank], signal.SIGKILL)

    def _stacks(self, attempt: int, live: dict[int, _Rank]) -> dict[int, str]:
        """Every live rank's stack file, asked for and read back."""
        paths = {rank: progress.stack_path(self.directory, rank, attempt) for rank in live}
        sizes = {rank: _size(path) for rank, path in paths.items()}
        for rank, r in live.items():
            _signal(r, progress.STACK_SIGNAL)
        deadline, steady = time.monotonic() + _STACK_WAIT_S, {}
        while time.monotonic() < deadline:  # each dump grown, then unchanged for a tenth of a second
            time.sleep(0.1)
            now_sizes = {rank: _size(path) for rank, path in paths.items()}
            if all(now_sizes[r] > sizes[r] and now_sizes[r] == steady.get(r) for r in paths):
                break
            steady = now_sizes
        dumps = {}
        for rank, path in paths.items():
            with contextlib.suppress(OSError):
                dumps[rank] = path.read_text(encoding="utf-8", errors="replace")
        return dumps

    def _keep_stacks(self, dumps: dict[int, str]) -> None:
        if self.stacks_to is None:
            for rank, dump in sorted(dumps.items()):
                print(f"qsdp: stack of rank {rank}:\n{dump}", file=sys.stderr, flush=True)
            return
        for rank, dump in dumps.items():
            with contextlib.suppress(OSError):
                (Path(self.stacks_to) / f"stack-rank{rank}.txt").write_text(dump, encoding="utf-8")

    def _stack_place(self) -> str:
        return "above" if self.stacks_to is None else str(Path(self.stacks_to) / "stack-rank*.txt")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _alive(r: _Rank) -> bool:
    """Whether the worker still runs as the process that wrote its pid file (a recycled pid is not it)."""
    start = progress.process_start(r.pid)
    return start is not None and (r.start is None or start == r.start) and progress.process_state(r.pid) not in ("Z", "X")


def _signal(r: _Rank, sig: int) -> None:
    """``sig`` to the worker, if it is still the process that wrote its pid file; a refusal or a
    process already gone is not the guard's failure."""
    if _alive(r):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(r.pid, sig)
