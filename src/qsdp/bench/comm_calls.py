"""The host cost of one step of each comm object, measured whole on the local ranks.

On a host-staged cluster (gloo on CPUs) a comm object's step costs far more than its bytes over
a copy rate and its codec kernels: the gloo call and its synchronisation, every codec call,
padding, transposes, temporaries and the Python around them. Rather than count those parts,
:func:`measure_call_seconds` times every step the performance model names
(:data:`qsdp.perfmodel.CALLS`) as the comm objects of :mod:`qsdp.comm` run it, on a shard of
:data:`SMALL_SHARD` and one of :data:`LARGE_SHARD` elements, and :func:`fit_calls` turns the two
times into a fixed cost per collective and a cost per element it carries, counting both as the
model does (:func:`qsdp.perfmodel.step_collectives` on gloo, ``host_staged``: a two-level
reduce-scatter's exchanges, one per hop for ``sdp4bit``'s ``pipeline_slices="auto"`` however
many slices it rounds, a node replica's rows). Each step is measured with the config of the first preset that uses it
(``zeropp``'s steps are priced with ``qsdp``'s and ``sdp4bit``'s: the cost is the code path's).

:func:`measure_call_seconds` runs inside every rank of
:func:`qsdp.bench.cluster_advice.measure_inputs`, all ranks together.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

SMALL_SHARD = 2048  # one weight quantization group, one two-level slice
LARGE_SHARD = 1 << 16  # a block of a small model: four two-level slices (one exchange on gloo)
# The preset whose config measures each step (qsdp.config.PRESETS).
CALL_PRESETS = {"gather": "fsdp", "quantized_gather": "qsdp", "difference_update": "sdp4bit",
                "replica_fill": "sdp4bit", "agreement": "sdp4bit", "reduce_scatter": "fsdp",
                "one_level_reduce_scatter": "qsdp", "two_level_slice": "sdp4bit"}


def median_seconds(fn: Callable[[], None], device: torch.device, repeats: int, *, barrier: bool = False) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call (for the difference
    gathers, the exact first gather of the replica), the device synchronised around each;
    ``barrier``: every rank starts each call together."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gather(comm, n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    rank, world = comm.topology.rank, comm.topology.world_size
    shard = torch.randn(n, device=device).to(dtype)
    out = torch.empty(world * n, device=device, dtype=dtype)
    mine = out[rank * n:(rank + 1) * n]

    def step() -> None:
        mine.copy_(shard)  # FSDP2 copies the shard in before it calls the comm
        comm(out, mine, comm.topology.group)

    return step


def _reduce_scatter(comm, n: int, device: torch.device) -> Callable[[], None]:
    grad = torch.randn(comm.topology.world_size * n, device=device)
    out = torch.empty(n, device=device)
    return lambda: comm(out, grad, comm.topology.group, dist.ReduceOp.AVG)


def _agreement(topology, device: torch.device) -> Callable[[], None]:
    flags = torch.zeros(2, dtype=torch.int32, device=device)

    def step() -> None:  # ChangeTracker._agree: one flag all-reduce and its host read
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topology.group)
        flags.tolist()

    return step


def measure_call_seconds(ranks_per_node: int, device: torch.device, param_dtype: torch.dtype,
                         sizes: tuple[int, ...] = (SMALL_SHARD, LARGE_SHARD),
                         repeats: int = 21) -> dict[str, list[float]]:
    """Seconds of one step of every comm object (keys of :data:`CALL_PRESETS`) on a shard of each
    of ``sizes`` elements, this rank's medians; ``difference_update`` is the changed gather less
    the fill that follows it. Collective: every rank of the world runs it together."""
    from qsdp.comm.all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
    from qsdp.comm.reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
    from qsdp.comm.topology import build_topology
    from qsdp.comm.versions import ChangeTracker
    from qsdp.config import resolve_config

    topo = build_topology(ranks_per_node=ranks_per_node)
    cfg = {name: resolve_config(preset) for name, preset in CALL_PRESETS.items()}
    out: dict[str, list[float]] = {name: [] for name in CALL_PRESETS}
    for n in sizes:
        steps = {
            "gather": _gather(PlainAllGather(cfg["gather"], topo, 1), n, device, param_dtype),
            "quantized_gather": _gather(QuantizedAllGather(cfg["quantized_gather"], topo, 2), n, device,
                                        param_dtype),
            # A tracker that never reports a change: every gather after the first only fills.
            "replica_fill": _gather(DifferenceAllGather(cfg["replica_fill"], topo, 3, ChangeTracker()), n, device,
                                    param_dtype),
            # One that always does (a comm on its own): every gather sends a difference and fills.
            "changed_gather": _gather(DifferenceAllGather(cfg["difference_update"], topo, 4), n, device,
                                      param_dtype),
            "agreement": _agreement(topo, device),
            "reduce_scatter": _reduce_scatter(PlainReduceScatter(cfg["reduce_scatter"], topo, 5), n, device),
            "one_level_reduce_scatter": _reduce_scatter(
                QuantizedReduceScatter(cfg["one_level_reduce_scatter"], topo, 6), n, device),
            "two_level_slice": _reduce_scatter(QuantizedReduceScatter(cfg["two_level_slice"], topo, 7), n, device),
        }
        t = {name: median_seconds(step, device, repeats, barrier=True) for name, step in steps.items()}
        t["difference_update"] = max(0.0, t.pop("changed_gather") - t["replica_fill"])
        for name in CALL_PRESETS:
            out[name].append(t[name])
    return out


def fit_calls(seconds: Mapping[str, Sequence[float]], nodes: int, ranks_per_node: int, param_bytes: int,
              sizes: tuple[int, int] = (SMALL_SHARD, LARGE_SHARD)) -> tuple[dict[str, float], dict[str, float]]:
    """(us per collective, ns per element) of every step from its times on shards of ``sizes``:
    the step's collectives in the model (their number ``k`` and elements ``e`` at each size)
    solve ``t = k * fixed + e * per_element``; a step whose elements do not grow (the agreement)
    or whose per-element cost comes out negative (noise) gets a fixed cost alone."""
    from qsdp.perfmodel import step_collectives

    fixed, per_element = {}, {}
    for name, times in seconds.items():
        counts = []
        for n in sizes:
            # measured on gloo, as the model's host-staged clusters run
            colls = [c for c in step_collectives(CALL_PRESETS[name], [n], nodes, ranks_per_node, gathers=1,
                                                 param_bytes=param_bytes, grad_bytes=4, host_staged=True)
                     if c.call == name]
            counts.append((len(colls), sum(c.elements for c in colls)))
        (k0, e0), (k1, e1) = counts
        t0, t1 = times
        det = k0 * e1 - k1 * e0
        a, b = ((t0 * e1 - t1 * e0) / det, (k0 * t1 - k1 * t0) / det) if det else (0.0, -1.0)
        if b < 0 or a < 0:
            a, b = (t0 / k0 + t1 / k1) / 2, 0.0
            if e1 and t1 / k1 > a:  # a fixed cost alone cannot be below the larger call's share
                a, b = t0 / k0, max(0.0, (t1 - k1 * t0 / k0) / e1)
        fixed[name], per_element[name] = a * 1e6, b * 1e9
    return fixed, per_element
