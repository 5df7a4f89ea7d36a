"""Running a training job from the command line: the checks before anything starts, then the
job itself, in this process under ``torchrun`` or in local worker processes otherwise.

Local workers are started by torch's elastic launcher (the machinery behind ``torchrun``) with a
c10d rendezvous on a free local port; with ``max_restarts`` it restarts them after a failure and
a restarted group resumes from the run's last checkpoint. A failure inside the workers becomes
one :class:`WorkerFailure` naming the root cause (the first rank that failed), not a traceback
from every rank. A worker stopped by a signal (SIGSTOP) for longer than ``--timeout`` is killed
and named as that root cause (:mod:`qsdp.watchdog`); a worker that makes no progress for that
long, wherever it is stuck, ends the job named with the ranks that waited for it, and every
rank's stack is written to ``--out`` (:mod:`qsdp.progress_guard`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from qsdp.launch import launch_local, under_torchrun
from qsdp.worker_start import started_processes
from qsdp.train.args import USER_ERRORS, PeerError, TrainArgs, validate_args
from qsdp.train.checkpoint import PeerLoadError
from qsdp.train.data import load_corpus
from qsdp.train.files import atomic_write
from qsdp.train.loop import train_worker
from qsdp.train.preflight import Plan, preflight, prepare_dataset, require_packages
from qsdp.progress import read_pid
from qsdp.progress_guard import StuckRankError
from qsdp.watchdog import Poller, StoppedWorkerWatch, signal_name, worker_pid_files

__all__ = ["UsageError", "WorkerFailure", "EXIT_USAGE", "run_training", "launch", "plan_run",
           "check_writable", "quiet_elastic_logs", "root_cause", "final_error", "worker_threads"]

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad input found by the command line itself: one line, exit code 2."""


class WorkerFailure(Exception):
    """The workers failed; ``code`` is the exit code, the message the root cause;
    ``traceback`` the root cause's traceback where no file could hold it (else ``None``)."""

    def __init__(self, message: str, code: int = 1, traceback: str | None = None) -> None:
        super().__init__(message)
        self.code, self.traceback = code, traceback


def check_writable(out: str) -> None:
    """UsageError unless ``out`` exists (created if need be) and accepts a file."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out directory {out!r}: {e.strerror or e}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".qsdp-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"--out directory {out!r} is not writable: {e.strerror or e}") from None


def _world_size(args: TrainArgs, nproc: int | None, max_restarts: int) -> int:
    """The number of ranks the job will have (torchrun's, or ``nproc`` local workers)."""
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be a non-negative integer, got {max_restarts}")
    if under_torchrun():
        if max_restarts:
            raise UsageError("--max-restarts is for the workers qsdp launches; under torchrun pass "
                             "torchrun's own --max-restarts")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if nproc is not None and nproc != world:
            raise UsageError(f"--nproc {nproc} conflicts with torchrun's WORLD_SIZE={world}; "
                             "leave --nproc out under torchrun")
        return world
    world = 1 if nproc is None else nproc
    if world < 1:
        raise UsageError(f"--nproc must be a positive number of processes, got {world}")
    check_open_files(world)
    if args.process_backend() == "nccl" and world > torch.cuda.device_count():
        raise UsageError(f"--nproc {world} needs {world} GPUs with NCCL (one a worker); this machine "
                         f"has {torch.cuda.device_count()}; pass --backend gloo to share GPUs")
    return world


# Open files the launching process holds per local worker (pipes and sentinels: 3.5 measured with
# 2 and 8 workers) and besides them; every worker holds about one socket per peer and process group.
_FILES_PER_WORKER, _FILES_BASE = 4, 64


def check_open_files(nproc: int) -> None:
    """UsageError unless the open-file limit (``ulimit -n``) allows ``nproc`` local workers
    (instead of an OSError 'too many open files' once they start)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return
    if soft == resource.RLIM_INFINITY:
        return
    most = (soft - _FILES_BASE) // _FILES_PER_WORKER
    if nproc > most:
        raise UsageError(f"--nproc {nproc} local workers need more open files than this shell allows "
                         f"(ulimit -n {soft}: at most {max(most, 0)} workers); raise the limit or launch "
                         "across machines with torchrun")


def plan_run(args: TrainArgs, nproc: int | None, *, prepare_data: bool,
             max_restarts: int = 0) -> Plan:
    """Check every input of a run before anything starts; returns the plan. ``prepare_data``
    also builds the dataset (and its caches) here, in the launching process, so the workers
    only read them."""
    config = validate_args(args)
    require_packages(args)
    world = _world_size(args, nproc, max_restarts)
    lws = args.local_world_size
    if lws is not None and world % lws:
        raise UsageError(f"--local-world-size {lws} must divide the number of processes {world} "
                         "(ranks per node x nodes)")
    created = _missing_ancestor(args.out)
    check_writable(args.out)
    try:
        if prepare_data:
            _, data_id = prepare_dataset(args)
        else:
            load_corpus(args.data)
            data_id = None
        return preflight(args, world, data_id, config)
    except BaseException:
        if created is not None:  # a refused run leaves no empty --out behind
            _remove_empty(Path(args.out), created)
        raise


def _missing_ancestor(path: str) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (None: it exists)."""
    missing = None
    for p in (Path(path).absolute(), *Path(path).absolute().parents):
        if p.exists():
            break
        missing = p
    return missing


def _remove_empty(path: Path, top: Path) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty."""
    p = path.absolute()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == top or p.parent == p:
            return
        p = p.parent


def final_error(error_dir: str | Path) -> dict[str, Any] | None:
    """The record of an earlier attempt's error that no restart can change, or ``None``: a bad
    input or an unusable checkpoint (a user error a rank raised itself, not a peer's consequence)."""
    for path in sorted(Path(error_dir).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if record.get("user") and not record.get("secondary"):
                return record
    return None


def _worker_entry(args: TrainArgs, plan: Plan, error_dir: str, threads: int | None = None) -> dict[str, Any] | None:
    """What each launched worker runs (top level, so the spawn start method can pickle it), with
    ``threads`` intra-op threads (:func:`worker_threads`) where given."""
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # what this worker's own children inherit
        torch.set_num_threads(threads)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) and final_error(error_dir) is not None:
        # The elastic agent restarts on any failure; this one would fail the same way again
        # (--max-restarts is for crashes): end at once, and the launcher reports the error.
        return None
    rank, attempt = int(os.environ.get("RANK", "-1")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    try:
        summary = train_worker(args, plan)
        return summary if rank == 0 else None
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        record = {
            "rank": rank, "time": time.time(), "type": type(e).__name__, "message": str(e), "attempt": attempt,
            "user": isinstance(e, USER_ERRORS), "secondary": isinstance(e, (PeerError, PeerLoadError)),
            "traceback": traceback.format_exc(),
        }
        with contextlib.suppress(OSError):
            path = Path(error_dir) / f"rank{rank}.attempt{attempt}.json"
            atomic_write(path, lambda f: f.write(json.dumps(record).encode("utf-8")))
        # Exit quietly: the launcher prints the root cause once. os._exit skips the interpreter's
        # teardown, where a process group whose peer died can abort in its C++ threads
        # ("terminate called without an active exception") and print a wall of noise.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher",
                    "torch.distributed.elastic.multiprocessing.api",
                    "torch.distributed.elastic.agent.server.api", "torch.multiprocessing",
                    "torch.multiprocessing.spawn")


@contextlib.contextmanager
def quiet_elastic_logs() -> Iterator[None]:
    """Silence the elastic launcher's own logging (the root cause is reported once instead)."""
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# A peer's death as the survivors' collectives report it (gloo, NCCL): a consequence, not a cause.
_PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "remote process exited")


def _lost_peer(record: dict[str, Any]) -> bool:
    return bool(record.get("secondary")) or any(p in str(record.get("message", "")).lower() for p in _PEER_LOST)


def _how(signal_name: str | None, exitcode: int | None) -> str:
    return f"killed by {signal_name}" if signal_name else f"exit code {exitcode}"


class DeathWatch(Poller):
    """How each local worker process ended and in which poll the launcher first saw it: a rank
    killed by a signal leaves no error record, and its peers' records only say that the
    connection closed.

    The end is seen on a ``pidfd`` of each worker (readable once the process has exited),
    whoever its parent is: the launcher for a spawned worker, the fork server for a forked one
    (:mod:`qsdp.worker_start`). How it ended is read with ``waitid(WNOWAIT)`` from a child not
    yet reaped (the elastic agent reaps it), else, after the launch, from the ``multiprocessing``
    process the agent started it as (:func:`qsdp.worker_start.started_processes`), which the
    fork server tells how its child ended."""

    def __init__(self, error_dir: Path, interval_s: float = 0.02) -> None:
        super().__init__(interval_s, "qsdp-death-watch", final_look=True)
        self.error_dir = error_dir
        self.deaths: dict[tuple[int, int], tuple[int, str | None, int | None]] = {}  # (attempt, rank) ->
        self._polls = 0                                                                # (poll, signal, code)
        self._watched: dict[tuple[int, int], tuple[int, int | None]] = {}  # (attempt, rank) -> (pid, pidfd)
        self._processes: dict[int, Any] = {}  # pid -> the multiprocessing process it was started as

    @staticmethod
    @functools.cache
    def sees_forked_workers() -> bool:
        """Whether this system gives the watch a ``pidfd`` of a process that is not its child:
        asked of the system once (a seccomp filter, as in some containers, refuses the call that
        Python has), not read from Python's features."""
        if not hasattr(os, "pidfd_open"):
            return False
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError:
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # the final look
        for key, (poll, signal, code) in self.deaths.items():
            if signal is None and code is None:  # the agent has joined its processes: each knows its end
                process = self._processes.get(self._watched[key][0])
                end = process.exitcode if process is not None else None
                if end is not None:
                    self.deaths[key] = (poll, signal_name(-end), None) if end < 0 else (poll, None, end)
        for _, pidfd in self._watched.values():
            if pidfd is not None:
                os.close(pidfd)
        self._watched.clear()

    def look(self) -> None:
        self._polls += 1
        self._processes.update(started_processes())
        for rank, attempt, path in worker_pid_files(self.error_dir):
            written = read_pid(path)
            if (attempt, rank) not in self._watched and written is not None:  # else: not written yet
                with contextlib.suppress(OSError):  # the process is gone
                    pid = written[0]
                    self._watched[(attempt, rank)] = (pid, os.pidfd_open(pid) if self.sees_forked_workers() else None)
        live = {key: ends for key, ends in self._watched.items() if key not in self.deaths}
        # poll, not select: select refuses descriptors numbered 1024 or more (a launcher used as a
        # library by a process with many files open).
        poller = select.poll()
        for _, pidfd in live.values():
            if pidfd is not None:
                poller.register(pidfd, select.POLLIN)
        ended = {fd for fd, _ in poller.poll(0)}
        for key, (pid, pidfd) in live.items():
            if pidfd is not None and pidfd not in ended:
                continue
            how = self._how(pid)  # (None, None): how it ended is read at the end (__exit__)
            if pidfd is None and how == (None, None):  # no pidfd here: only a child's end, from waitid
                continue
            self.deaths[key] = (self._polls, *how)

    @staticmethod
    def _how(pid: int) -> tuple[str | None, int | None]:
        """``(signal, None)`` or ``(None, exit code)`` of an ended child not reaped yet; else ``(None, None)``."""
        try:
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # another process's child, or reaped already
            return None, None
        if status is None:
            return None, None
        if status.si_code == os.CLD_EXITED:
            return None, status.si_status
        return signal_name(status.si_status), None  # killed, or dumped core


def root_cause(error_dir: Path, failures: dict[int, Any], out: str,
               deaths: dict[tuple[int, int], tuple[int, str | None, int | None]] | None = None) -> WorkerFailure:
    """The failure to report, of the last attempt: the first rank's own error record (a rank stopped
    by a signal counts from when the launcher first saw it stopped, before its peers' timeouts); else the
    rank that died first without one (killed, or an exit code of its own), as ``deaths``
    (:class:`DeathWatch`) or the elastic agent's ``failures`` saw it, before the peers that then
    lost their connection to it; else the first record."""
    records = []
    for path in error_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text(encoding="utf-8")))
    attempts = [r.get("attempt", 0) for r in records] + [a for a, _ in (deaths or {})]
    last = max(attempts, default=0)  # with --max-restarts: the final attempt
    records = [r for r in records if r.get("attempt", 0) == last]
    primary = [r for r in records if not _lost_peer(r)]
    if primary:
        return _record_failure(min(primary, key=lambda r: (r["time"], not r["user"])), out)
    reported = {r["rank"] for r in records}
    silent = {rank: death for (attempt, rank), death in (deaths or {}).items()
              if attempt == last and rank not in reported and (death[1] or death[2])}
    first_poll = min((poll for (attempt, _), (poll, _, _) in (deaths or {}).items() if attempt == last), default=None)
    # A silent death seen in the launcher's first poll that saw any: ranks the agent stops once it
    # noticed a failure die later and are not the cause.
    dead = sorted(rank for rank, (poll, _, _) in silent.items() if poll == first_poll)
    lost = f"; {_peers(records)} then lost the connection" if records else ""
    if dead:
        rank = dead[0]
        return WorkerFailure(f"rank {rank} died first ({_how(*silent[rank][1:])}) without reporting an error{lost}")
    # The launcher's watch missed it (the agent reaped the process first, under load): the agent's
    # failures are the exits of its first poll that saw any, the same "first" as the watch's.
    for rank, failure in sorted(failures.items()):
        if rank not in reported:
            how = _how(failure.signal_name() if failure.exitcode < 0 else None, failure.exitcode)
            return WorkerFailure(f"rank {rank} died first ({how}) without reporting an error{lost}")
    if records:
        return _record_failure(min(records, key=lambda r: r["time"]), out)
    return WorkerFailure("the workers failed without reporting an error")


def _peers(records: list[dict[str, Any]]) -> str:
    ranks = sorted({r["rank"] for r in records})
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _record_failure(first: dict[str, Any], out: str) -> WorkerFailure:
    if first.get("stopped") or first.get("stuck"):  # the launcher's watches wrote it: one line, no traceback
        return WorkerFailure(first["message"])
    if first["user"]:
        return WorkerFailure(first["message"], EXIT_USAGE)
    message = f"rank {first['rank']}: {first['type']}: {first['message']}"
    try:
        path = Path(out) / "error.txt"
        path.write_text(first["traceback"], encoding="utf-8")
    except OSError:  # the traceback still reaches the terminal
        return WorkerFailure(message, traceback=first["traceback"] or None)
    return WorkerFailure(f"{message} (traceback: {path})")


def worker_threads(nproc: int) -> int:
    """The intra-op threads of each of ``nproc`` local workers: ``OMP_NUM_THREADS`` where the
    launcher's environment sets it, else the machine's cores shared by the workers (torchrun's
    default is one a worker).

    Each worker sets them itself (:func:`_worker_entry`) rather than reading a variable the launcher
    would write into its own environment: that write would leave the process's environment
    different from the one its fork server started with, and every later local launch of the
    process (this one's restarts, a benchmark's: :mod:`qsdp.worker_start`) would spawn its workers
    instead, 3.5 s of imports each."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // nproc)


def launch(args: TrainArgs, plan: Plan, max_restarts: int = 0) -> dict[str, Any]:
    """Run ``train_worker(args, plan)`` in ``plan.world_size`` local processes (restarted up to
    ``max_restarts`` times; a restarted group resumes from the run's last checkpoint); returns
    rank 0's summary."""
    nproc = plan.world_size
    error_dir = Path(tempfile.mkdtemp(prefix="qsdp-errors-"))
    watch = DeathWatch(error_dir)
    try:
        with quiet_elastic_logs(), watch, StoppedWorkerWatch(error_dir, args.timeout_s):
            results = launch_local(_worker_entry, nproc, args, plan, str(error_dir), worker_threads(nproc),
                                   max_restarts=max_restarts, fork=DeathWatch.sees_forked_workers(),
                                   timeout_s=args.timeout_s, watch_dir=str(error_dir), stacks_to=args.out,
                                   timeout_name="--timeout")
        if final_error(error_dir) is not None:  # the restart ended at once: report what it would repeat
            raise root_cause(error_dir, {}, args.out)
    except (ChildFailedError, StuckRankError) as e:  # the guard's record names the stuck rank
        raise root_cause(error_dir, getattr(e.__cause__ or e, "failures", {}), args.out, watch.deaths) from None
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
    return results[0]


def run_training(args: TrainArgs, nproc: int | None = None, max_restarts: int = 0) -> dict[str, Any]:
    """Validate and run one training job (the ``qsdp train`` command without the printing);
    returns the summary. Raises UsageError / the loop's user errors / WorkerFailure."""
    if under_torchrun():
        return train_worker(args, plan_run(args, nproc, prepare_data=False, max_restarts=max_restarts))
    plan = plan_run(args, nproc, prepare_data=True, max_restarts=max_restarts)
    return launch(args, plan, max_restarts)
