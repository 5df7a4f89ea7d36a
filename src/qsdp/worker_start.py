"""How :func:`qsdp.launch.launch_local` starts its workers: forked from a server that imported
torch and qsdp once, instead of a fresh interpreter per worker.

A spawned worker imports torch, its distributed stack and qsdp before it runs a line of the
job: about 3.5 s of a core each, paid again by every worker of every restart. Python's
``forkserver`` start method imports them once, in a server process started at the first launch
(:data:`PRELOAD`), and forks each worker from it. A forked worker differs from a spawned one in
two ways, and both are handled here:

* its environment is the server's, taken when the server started. Libraries read some variables
  at import (``OMP_NUM_THREADS``, ``TORCH_LOGS``), so a worker cannot simply be handed a newer
  one: the forkserver is used only while this process's environment is the one the server
  started with (:func:`start_method`), and a launch after a change spawns its workers;
  qsdp's own variables that it reads only when it uses them (:data:`RUNTIME_VARIABLES`) are
  the exception: a worker takes the launcher's values of those, so setting one between two
  launches keeps the server;
* its stdout and stderr are the server's. :class:`LauncherStdio` hands each worker the
  launcher's own at the launch, as a spawned worker inherits them (what a test's output capture
  or a redirected launcher expects).

The server is a private detail of Python's ``multiprocessing`` (a process-wide one, which other
libraries may start first); :func:`start_method` reads whether it runs through one private
field and spawns whenever it cannot tell whose it is.

A forked worker is the server's child, not the launcher's: the launcher cannot ``waitid`` it.
How it ended reaches the launcher through ``multiprocessing``'s own process object, which the
elastic agent keeps to itself; :func:`started_processes` finds those objects in
``multiprocessing``'s registry of this process's children (another private field).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from typing import Any, Callable

__all__ = ["PRELOAD", "RUNTIME_VARIABLES", "LauncherStdio", "start_method", "runtime_values", "run_entry",
           "watched_entry", "started_processes"]

# What every worker imports anyway: torch with FSDP2's stack, and qsdp's training path.
# torch._dynamo: FSDP2's first fully_shard imports it (about 1 s of a core, per worker otherwise).
# qsdp_fork_server first: the server imports on one thread, so its children can run on any number.
PRELOAD = ("qsdp_fork_server", "torch", "torch.distributed.fsdp", "torch._dynamo", "qsdp.launch", "qsdp.train.launcher")
# Variables written into the launching process's own environment by the tools around it, which no
# worker reads: torch's elastic launcher's signal list, and pytest's name of the running test.
_SET_BY_LAUNCHER = frozenset({"TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTEST_CURRENT_TEST"})

# Variables read when they are used, never at import: qsdp's own (unlike QSDP_TRITON_ON_CPU), the
# node a rank names, the token cache, the codec choice per call, the fault injections; and
# inductor's cache folder, which torch itself writes into the environment of a process that
# compiles (a launcher that ran torch.compile would otherwise never fork again).
RUNTIME_VARIABLES = frozenset({"QSDP_NODE", "QSDP_CACHE_DIR", "QSDP_DISABLE_TRITON", "QSDP_TEST_KILL_AT",
                               "QSDP_TEST_NAN_AT", "QSDP_TEST_STALL_AT", "QSDP_TEST_HOLD_AT",
                               "TORCHINDUCTOR_CACHE_DIR"})

_server_env: dict[str, str] | None = None  # this process's environment when it started the server


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _SET_BY_LAUNCHER and k not in RUNTIME_VARIABLES}


def _server_running() -> bool | None:
    """Whether Python's forkserver runs in this process; ``None`` where that cannot be read."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        return None
    return server._forkserver_pid is not None  # noqa: SLF001 - see the module doc


def start_method() -> str:
    """``"forkserver"`` when workers forked from the server see this process's environment,
    ``"spawn"`` otherwise (the environment changed since the server started, or a server
    started by other code runs). The first call arranges the server's imports and starts it."""
    global _server_env
    if os.environ.get("QSDP_WORKER_START") == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _server_env is None:
        if _server_running() is not False:
            return "spawn"
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        _server_env = _environment()
        multiprocessing.forkserver.ensure_running()
        return "forkserver"
    env = _environment()
    if env == _server_env:
        return "forkserver"
    changed = sorted(k for k in env.keys() | _server_env.keys() if env.get(k) != _server_env.get(k))
    logging.getLogger(__name__).info("spawning workers: the environment changed since the fork server started (%s)",
                                     ", ".join(changed))
    return "spawn"


def _adopt_stdio(out: Any, err: Any) -> tuple[int, int]:
    """In a worker, while its arguments are unpickled: the launcher's stdout and stderr on fds 1
    and 2 (before the elastic agent applies any redirection of its own)."""
    for target, fd in ((1, out.detach()), (2, err.detach())):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    return (1, 2)


class LauncherStdio:
    """The launcher's stdout and stderr as they are when a worker starts; pickled, it passes
    both descriptors to the worker (``multiprocessing.reduction.DupFd``), which puts them on its
    fds 1 and 2 as it is unpickled."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, Any]]:
        from multiprocessing.reduction import DupFd

        return _adopt_stdio, (DupFd(1), DupFd(2))


def runtime_values() -> dict[str, str | None]:
    """The launcher's values of :data:`RUNTIME_VARIABLES` (``None``: unset), for :func:`run_entry`."""
    return {name: os.environ.get(name) for name in RUNTIME_VARIABLES}


def run_entry(fn: Callable[..., Any], _stdio: Any, values: dict[str, str | None], *args: Any) -> Any:
    """What a forked worker runs: ``fn(*args)`` with the launcher's ``values`` of
    :data:`RUNTIME_VARIABLES` and the intra-op threads a spawned worker would have (the server
    ran on one: :mod:`qsdp_fork_server`); ``_stdio`` did its work while unpickled."""
    server = sys.modules.get("qsdp_fork_server")
    if server is not None:
        import torch

        torch.set_num_threads(server.INTRA_OP_THREADS)
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return fn(*args)


def watched_entry(directory: str, fn: Callable[..., Any], *args: Any) -> Any:
    """What every local worker runs, forked or spawned: ``fn(*args)`` once it has told the
    launcher's watches its pid and set up its progress marks and stack dump in ``directory``
    (:func:`qsdp.progress.start`)."""
    from qsdp import progress

    rank = int(os.environ.get("RANK", "0"))
    progress.start(directory, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    result = fn(*args)
    progress.mark(progress.FINISHED)  # waiting for its peers to end is not being stuck
    return result


def started_processes() -> dict[int, multiprocessing.process.BaseProcess]:
    """The ``multiprocessing`` processes this process started and has not joined yet, by pid
    (the workers of a running local launch among them), without asking any of them how it is:
    a process's ``exitcode`` reads its end from a pipe once, so a second thread asking while the
    elastic agent joins the process could take the agent's answer (and give it a made-up one).
    Empty where ``multiprocessing`` keeps no such registry (a Python this code does not know)."""
    children = getattr(multiprocessing.process, "_children", None)  # noqa: SLF001 - see the module doc
    if not isinstance(children, set):
        return {}
    return {process.pid: process for process in list(children) if process.pid is not None}
