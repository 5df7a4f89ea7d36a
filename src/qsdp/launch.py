"""Local multi-process launches through torch's elastic agent (the machinery behind torchrun).

qsdp has no launcher of its own: ``launch_local`` asks ``torch.distributed.launcher`` for
``nproc`` workers on this machine with a c10d rendezvous on a free loopback port, and returns
each worker's return value. Multi-node runs use ``torchrun`` directly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when this process is already a worker of an external torchrun / elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


# How long a local worker may go without progress before the guard ends the launch (qsdp train's
# --timeout default; a worker keeping a core busy counts as progressing: qsdp.progress_guard).
DEFAULT_TIMEOUT_S = 600.0


def _config(nproc: int, max_restarts: int, log_dir: str | None, method: str) -> Any:
    """torch's launch configuration: ``nproc`` workers on this machine, a c10d rendezvous on a free
    loopback port, workers started by ``method``."""
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"qsdp-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method=method, logs_specs=None)
    if log_dir is not None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

        config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
    return config


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    max_restarts: int = 0,
    log_dir: str | None = None,
    fork: bool = True,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    watch_dir: str | None = None,
    stacks_to: str | None = None,
    timeout_name: str = "the launch's timeout",
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local worker processes (``fn`` must be a picklable
    top-level function; each worker finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
    MASTER_ADDR/PORT in its environment). Returns ``{rank: return value}``. A failed worker
    raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``.

    Workers are forked from a server that imported torch and qsdp once per process
    (:mod:`qsdp.worker_start`), or spawned where that server would not see this process's
    environment; ``QSDP_WORKER_START=spawn`` or ``fork=False`` always spawns them (a caller that
    must have its workers as its own children: ``qsdp train`` where its death watch cannot see
    another process's, :class:`qsdp.train.launcher.DeathWatch`).

    A worker that makes no progress for ``timeout_s`` seconds (``None``: unguarded) ends the
    launch with :class:`qsdp.progress_guard.StuckRankError` naming it, within the timeout
    plus :data:`qsdp.progress.GRACE_S`; every rank's Python stack goes to ``stacks_to`` as
    ``stack-rank{R}.txt`` (``None``: standard error). ``watch_dir``: where the workers write their
    pid, progress and stack files (a temporary folder by default); ``timeout_name``: how the
    message calls the timeout (the option that set it)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from .progress_guard import ProgressGuard, StuckRankError
    from .worker_start import LauncherStdio, run_entry, runtime_values, start_method, watched_entry

    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    method = start_method() if fork else "spawn"
    config = _config(nproc, max_restarts, log_dir, method)
    directory = watch_dir if watch_dir is not None else tempfile.mkdtemp(prefix="qsdp-watch-")
    guard = ProgressGuard(directory, timeout_s, stacks_to, timeout_name) if timeout_s is not None else None
    try:
        with guard if guard is not None else contextlib.nullcontext():
            if method == "spawn":
                return elastic_launch(config, watched_entry)(directory, fn, *args)
            return elastic_launch(config, run_entry)(watched_entry, LauncherStdio(), runtime_values(), directory,
                                                     fn, *args)
    except ChildFailedError as e:
        stuck = guard.ended_last_attempt() if guard is not None else None
        if stuck is not None:
            raise StuckRankError(stuck) from e
        raise
    finally:
        if watch_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
