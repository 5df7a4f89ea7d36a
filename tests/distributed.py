"""Run a function on a real process group (gloo, or NCCL with one GPU a rank) of N local
processes, with a hard deadline.

Children are forked from the test process (torch is already imported, so a world starts in a
fraction of a second), or spawned (``start_method="spawn"``) where the test process may already
hold a CUDA context, which a forked child cannot use. Each child returns a picklable value or
raises; the parent re-raises the first child error with its traceback, and kills every child and
fails if the deadline passes, so a hang costs at most ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
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


def on_one_rank_nodes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every rank on a node of its own (``QSDP_NODE``), while ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` stay those of one machine: frameworks that pick devices, caches or
    their local main process by local rank (Accelerate, the HF Trainer, Lightning) see one
    node as they would, and qsdp sees nodes that weight differences cross."""
    def run(rank, world, *args, **kwargs):
        os.environ["QSDP_NODE"] = f"node{rank}"
        return fn(rank, world, *args, **kwargs)
    return run


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
                break
    finally:
        released.set()
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("a rank failed:\n" + errors[0])
    return [results[r] for r in range(world_size)]
