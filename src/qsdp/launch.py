"""Local multi-process launches through torch's elastic agent (the machinery behind torchrun).

qsdp has no launcher of its own: ``launch_local`` asks ``torch.distributed.launcher`` for
``nproc`` workers on this machine with a c10d rendezvous on a free loopback port, and returns
each worker's return value. Multi-node runs use ``torchrun`` directly.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when this process is already a worker of an external torchrun / elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    max_restarts: int = 0,
    log_dir: str | None = None,
    fork: bool = True,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local worker processes (``fn`` must be a picklable
    top-level function; each worker finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
    MASTER_ADDR/PORT in its environment). Returns ``{rank: return value}``. A failed worker
    raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``.

    Workers are forked from a server that imported torch and qsdp once per process
    (:mod:`qsdp.worker_start`), or spawned where that server would not see this process's
    environment; ``QSDP_WORKER_START=spawn`` or ``fork=False`` always spawns them (a caller that
    must have its workers as its own children: ``qsdp train`` where its death watch cannot see
    another process's, :class:`qsdp.train.launcher.DeathWatch`)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker_start import LauncherStdio, run_entry, runtime_values, start_method

    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"qsdp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=(method := start_method() if fork else "spawn"),
        logs_specs=None,
    )
    if log_dir is not None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

        config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
    if method == "spawn":
        return elastic_launch(config, fn)(*args)
    return elastic_launch(config, run_entry)(fn, LauncherStdio(), runtime_values(), *args)
