"""Run a function on a real process group (gloo, or NCCL with one GPU a rank) of N local
processes, with a hard deadline.

Children are forked from the test process (torch is already imported, so a world starts in a
fraction of a second), or spawned (``start_method="spawn"``) where the test process may already
hold a CUDA context, which a forked child cannot use. Each child returns a picklable value or
raises; the parent re-raises the first child error with its traceback, and kills every child and
fails if the deadline passes, so a hang costs at most ``timeout`` seconds.

``run_pooled`` does the same on forked gloo worlds kept from one test to the next (one per
world size, ranks per node and group timeout): most tests use it, and pay a world's start-up
once per run rather than once per test (see the comment above it for what it resets).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import traceback
from typing import Any, Callable

from qsdp.launch import free_port


def _child(fn, rank, world_size, port, local_world_size, pg_timeout, backend, queue, released, deadline_s,
           args, kwargs):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size), LOCAL_WORLD_SIZE=str(local_world_size),
        # The node this rank emulates: qsdp places ranks on nodes by name, not by position.
        QSDP_NODE=f"node{rank // local_world_size}",
    )
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args, **kwargs)
        # Plain pickle bytes: the queue's own pickler would pass tensors through shared memory,
        # which deadlocks when the child exits before the parent has read them.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Rank 0 hosts the group's store: had it left as soon as its own work was done, a peer
        # still creating a subgroup rank 0 is not in would lose the store mid-rendezvous.
        released.wait(timeout=deadline_s)
        if dist.is_initialized():
            dist.destroy_process_group()


class on_one_rank_nodes:  # noqa: N801 - used as a function: on_one_rank_nodes(fn)
    """``fn`` with every rank on a node of its own (``QSDP_NODE``), while ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` stay those of one machine: frameworks that pick devices, caches or
    their local main process by local rank (Accelerate, the HF Trainer, Lightning) see one
    node as they would, and qsdp sees nodes that weight differences cross. A class rather
    than a closure so that it pickles (:func:`run_pooled`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, rank, world, *args, **kwargs):
        os.environ["QSDP_NODE"] = f"node{rank}"
        return self.fn(rank, world, *args, **kwargs)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_world_size: int | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    start_method: str = "fork",
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for each rank]`` computed in ``world_size``
    processes joined by a ``backend`` group, emulating nodes of ``local_world_size`` consecutive
    ranks (``QSDP_NODE`` and ``LOCAL_WORLD_SIZE`` set as on such nodes; ``nccl``: rank ``r`` on
    GPU ``r``). ``start_method="spawn"`` needs ``fn`` importable by name (a test module's
    function)."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    released = ctx.Event()  # set once the parent has every result (or an error): ranks may exit
    port = free_port()
    lws = local_world_size or world_size
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, lws, pg_timeout, backend, queue, released, timeout,
                                         args, kwargs))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s (ranks done: {sorted(results)})")
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for children that died without reporting
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead and queue.empty():
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                errors += _late_errors(queue, world_size - len(results) - 1)
                break
    finally:
        released.set()
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(sorted(errors, key=_is_echo)))
    return [results[r] for r in range(world_size)]


def _late_errors(queue, pending: int, report=lambda item: item, grace_s: float = 5.0) -> list[str]:
    """The errors other ranks report within ``grace_s`` of the first: a rank that fails makes its
    peers fail too (a closed connection), and the first to arrive is often such an echo.
    ``report`` turns a queued item into ``(rank, ok, value)``, or None for one to skip."""
    errors = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=grace_s)
    while pending > 0 and (remaining := (deadline - datetime.datetime.now()).total_seconds()) > 0:
        try:
            item = report(queue.get(timeout=remaining))
        except Exception:  # queue.Empty: the others are still working or hung
            break
        if item is None:
            continue
        rank, ok, value = item
        pending -= 1
        if not ok:
            errors.append(f"rank {rank}:\n{value}")
    return errors


def _is_echo(error: str) -> bool:
    """Whether ``error`` is a rank losing its peers (sorted after the error that caused it)."""
    return any(s in error for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


# ---------------------------------------------------------------------------------------------
# A pool of worlds kept for the whole test run.
#
# A fresh world costs a fork per rank, a store rendezvous and gloo's full mesh of connections:
# a fraction of a second, paid again by every test and every parametrization. ``run_pooled``
# keeps one world per (world size, ranks per node, group timeout) and hands it each test's
# function in turn, as torch's MultiProcContinuousTest does. What a test leaves behind in a
# world that a fresh one would not have is undone or retires the world:
#
# - every function runs in the caller's environment and directory, as a rank forked at the call
#   would (tests set both with monkeypatch), with the rank's own world variables on top;
# - qsdp's per-world state (topologies, subgroups, start-up bytes) starts afresh, as it does in a
#   new world; the subgroups are kept, not destroyed: torch would give a subgroup made again the
#   name of the destroyed one, whose addresses are still in the store;
# - a rank's error, a deadline passed, a default group destroyed by the function, ranks holding
#   different numbers of process groups (torch names subgroups by that number), or more than
#   ``_RETIRE_AFTER`` tests: the world is killed and the next test gets a new one.
#
# A hang fails its own test (the deadline kills the world), never the run.


_RETIRE_AFTER = 40  # tests per world: each may leave gloo subgroups (sockets, threads) behind
_POOLS: dict[tuple, "_Pool"] = {}
_MAX_POOLS = 2  # worlds alive at once (each holds a process per rank)


_WORLD_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "QSDP_NODE")


def _pool_worker(rank, world_size, port, lws, pg_timeout, tasks, results):
    import torch
    import torch.distributed as dist

    from qsdp.comm import topology

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % lws), LOCAL_WORLD_SIZE=str(lws), QSDP_NODE=f"node{rank // lws}",
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    world = dist.group.WORLD
    own = {var: os.environ[var] for var in _WORLD_VARS}
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                break  # the test run was killed without closing its worlds: do not outlive it
            continue
        if task is None:
            break
        serial, payload, environ, cwd = task
        # What a rank forked at the call would have: the caller's environment and directory
        # (tests set both with monkeypatch), this rank's place in the world on top.
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(own)
        os.chdir(cwd)
        topology._STATE = None  # a fresh world's qsdp state, the subgroups made so far kept
        try:
            fn, args, kwargs = pickle.loads(payload)
            message = (serial, rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            message = (serial, rank, False, traceback.format_exc())
        reusable = message[2] and dist.is_initialized() and dist.group.WORLD is world
        if reusable:
            # Also a check that the world still works: a test that let a collective time out
            # (a silent peer) leaves gloo's connections closed, and this exchange fails.
            held: list[Any] = [None] * world_size
            try:
                dist.all_gather_object(held, len(dist.distributed_c10d._world.pg_names))
                reusable = len(set(held)) == 1
            except RuntimeError:
                reusable = False
        results.put((*message, reusable))
        if not reusable:
            break


class _Pool:
    """``world_size`` forked ranks in one gloo world, running one function at a time."""

    def __init__(self, world_size: int, lws: int, pg_timeout: float) -> None:
        ctx = mp.get_context("fork")
        self.world_size, self.used = world_size, 0
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world_size, port, lws, pg_timeout,
                                                              self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, payload: bytes, timeout: float) -> tuple[list[Any], bool]:
        """Every rank's result (or the first rank's error raised) and whether the world may
        serve another test."""
        serial = next(_SERIALS)
        self.used += 1
        environ, cwd = dict(os.environ), os.getcwd()
        for q in self.tasks:
            q.put((serial, payload, environ, cwd))
        results: dict[int, Any] = {}
        reusable = self.used < _RETIRE_AFTER
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s (ranks done: {sorted(results)})")
            try:
                got_serial, rank, ok, value, rank_reusable = self.results.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [i for i, p in enumerate(self.procs) if p.exitcode is not None and i not in results]
                if dead and self.results.empty():
                    raise RuntimeError(f"ranks {dead} died with exit codes {[self.procs[i].exitcode for i in dead]}")
                continue
            if got_serial != serial:
                continue
            if not ok:
                errors = [f"rank {rank}:\n{value}"] + _late_errors(
                    self.results, self.world_size - len(results) - 1,
                    lambda item: item[1:4] if item[0] == serial else None)
                raise RuntimeError("a rank failed:\n" + "\n".join(sorted(errors, key=_is_echo)))
            results[rank] = pickle.loads(value)
            reusable = reusable and rank_reusable
        return [results[r] for r in range(self.world_size)], reusable

    def close(self) -> None:
        """Kill every rank: a world is closed when it failed, was retired or the run ends, and
        in the first two cases some rank may be waiting in a collective that will never end."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_SERIALS = itertools.count()


def _close_pools() -> None:
    while _POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()


atexit.register(_close_pools)


def run_pooled(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_world_size: int | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    start_method: str = "fork",
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """:func:`run_world` (gloo, forked ranks) on a world kept from one test to the next: the
    same results, errors and deadline, without a world's start-up per call. ``fn`` and its
    arguments travel by pickle to ranks forked before the call, so ``fn`` must be a module-level
    function (or an instance of a module-level class) of a module imported before the world
    was made: a test module's function is; anything else (a closure, a lambda) runs in a fresh
    world by :func:`run_world`, and so does a spawned or NCCL world (a GPU's ranks are not kept
    from one test to the next). The ranks run in the caller's environment and directory; what
    the caller changed in its modules (``monkeypatch.setattr``) they do not see: such a test
    calls :func:`run_world`, whose ranks are forked at the call."""
    def fresh() -> list[Any]:
        return run_world(fn, world_size, *args, local_world_size=local_world_size, timeout=timeout,
                         pg_timeout=pg_timeout, start_method=start_method, backend=backend, **kwargs)

    if start_method != "fork" or backend != "gloo":
        return fresh()
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError):
        return fresh()
    key = (world_size, local_world_size or world_size, pg_timeout)
    pool = _POOLS.pop(key, None)
    while len(_POOLS) >= _MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    pool = pool or _Pool(*key)
    reusable = False
    try:
        results, reusable = pool.run(payload, timeout)
    finally:
        if reusable:
            _POOLS[key] = pool  # the most recently used last
        else:
            pool.close()
    return results
