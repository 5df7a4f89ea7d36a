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
many slices it rounds, a node replica's rows). Each preset's steps are measured with its own
config: a step costs what its codecs cost (``zeropp``'s 4-bit gathers and its two-level
reduce-scatter without the Hadamard transform are not ``qsdp``'s 8-bit gathers and
``sdp4bit``'s Hadamard-smoothed one), and a step the same in two presets is measured twice.

:func:`measure_call_seconds` runs inside every rank of
:func:`qsdp.bench.cluster_advice.measure_inputs`, all ranks together.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

SMALL_SHARD = 2048  # one weight quantization group, one two-level slice
LARGE_SHARD = 1 << 16  # a block of a small model: four two-level slices (one exchange on gloo)

K = TypeVar("K")


def median_seconds(fn: Callable[[], None], device: torch.device, repeats: int, *, barrier: bool = False) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call (for the difference
    gathers, the exact first gather of the replica), the device synchronised around each;
    ``barrier``: every rank starts each call together."""
    return interleaved_median_seconds({None: fn}, device, repeats, barrier=barrier)[None]


def interleaved_median_seconds(fns: Mapping[K, Callable[[], None]], device: torch.device, repeats: int, *,
                               barrier: bool = False) -> dict[K, float]:
    """:func:`median_seconds` of each of ``fns``, taken in rounds that call every one of them
    once: a machine that slows down for a while (other jobs, frequency changes) slows them all
    alike, not those measured in that while."""
    for fn in fns.values():
        fn()
    times: dict[K, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


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


def preset_calls(preset: str, nodes: int, ranks_per_node: int) -> tuple[str, ...]:
    """The comm steps (:data:`qsdp.perfmodel.CALLS`) a step of ``preset`` runs on ``nodes`` x
    ``ranks_per_node`` ranks of gloo, on the shards :func:`measure_call_seconds` times."""
    from qsdp.perfmodel import CALLS, step_collectives

    used = {c.call for n in (SMALL_SHARD, LARGE_SHARD)
            for c in step_collectives(preset, [n], nodes, ranks_per_node, gathers=1, host_staged=True)}
    return tuple(name for name in CALLS if name in used)


def _step(name: str, cfg, topology, comm_id: int, n: int, device: torch.device,
          param_dtype: torch.dtype) -> Callable[[], None]:
    """One step of comm step ``name`` on a shard of ``n`` elements, run by a comm object of
    ``cfg``; ``difference_update`` gives the whole changed gather (its fill included)."""
    from qsdp.comm.all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
    from qsdp.comm.reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
    from qsdp.comm.versions import ChangeTracker

    if name == "gather":
        return _gather(PlainAllGather(cfg, topology, comm_id), n, device, param_dtype)
    if name == "quantized_gather":
        return _gather(QuantizedAllGather(cfg, topology, comm_id), n, device, param_dtype)
    if name == "replica_fill":  # a tracker that never reports a change: every gather after the first fills
        return _gather(DifferenceAllGather(cfg, topology, comm_id, ChangeTracker()), n, device, param_dtype)
    if name == "difference_update":  # one that always does (a comm on its own): a difference, then a fill
        return _gather(DifferenceAllGather(cfg, topology, comm_id), n, device, param_dtype)
    if name == "agreement":
        return _agreement(topology, device)
    if name == "reduce_scatter":
        return _reduce_scatter(PlainReduceScatter(cfg, topology, comm_id), n, device)
    if name in ("one_level_reduce_scatter", "two_level_slice"):
        return _reduce_scatter(QuantizedReduceScatter(cfg, topology, comm_id), n, device)
    raise ValueError(f"unknown comm step {name!r}")


def measure_call_seconds(ranks_per_node: int, device: torch.device, param_dtype: torch.dtype,
                         presets: Sequence[str], sizes: tuple[int, ...] = (SMALL_SHARD, LARGE_SHARD),
                         repeats: int = 31) -> dict[str, dict[str, list[float]]]:
    """Seconds of one step of every comm step each of ``presets`` runs (:func:`preset_calls`),
    by a comm object of that preset's config, on a shard of each of ``sizes`` elements: this
    rank's medians, ``{preset: {step: [seconds per size]}}``, all taken in the same rounds
    (:func:`interleaved_median_seconds`); ``difference_update`` is the changed gather less the
    fill that follows it. Collective: every rank of the world runs it together."""
    from qsdp.comm.topology import build_topology
    from qsdp.config import resolve_config

    topo = build_topology(ranks_per_node=ranks_per_node)
    nodes = topo.world_size // ranks_per_node
    comm_ids = itertools.count(1)
    steps: dict[tuple[str, str, int], Callable[[], None]] = {}
    for preset in presets:
        cfg = resolve_config(preset)
        for name in preset_calls(preset, nodes, ranks_per_node):
            for n in sizes:
                steps[preset, name, n] = _step(name, cfg, topo, next(comm_ids), n, device, param_dtype)
    t = interleaved_median_seconds(steps, device, repeats, barrier=True)
    out: dict[str, dict[str, list[float]]] = {}
    for (preset, name, n), seconds in t.items():
        if name == "difference_update":
            seconds = max(0.0, seconds - t[preset, "replica_fill", n])
        out.setdefault(preset, {}).setdefault(name, []).append(seconds)
    return out


def fit_calls(seconds: Mapping[str, Mapping[str, Sequence[float]]], nodes: int, ranks_per_node: int,
              param_bytes: int, sizes: tuple[int, int] = (SMALL_SHARD, LARGE_SHARD),
              ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(us per collective, ns per element) of every preset's comm steps, ``{preset: {step:
    value}}``, from their times on shards of ``sizes`` (:func:`measure_call_seconds`): the
    step's collectives in the preset's step (their number ``k`` and elements ``e`` at each size)
    solve ``t = k * fixed + e * per_element``; a step whose elements do not grow (the agreement)
    or whose per-element cost comes out negative (noise) gets a fixed cost alone."""
    from qsdp.perfmodel import step_collectives

    fixed: dict[str, dict[str, float]] = {}
    per_element: dict[str, dict[str, float]] = {}
    for preset, steps in seconds.items():
        fixed[preset], per_element[preset] = {}, {}
        for name, times in steps.items():
            counts = []
            for n in sizes:
                # measured on gloo, as the model's host-staged clusters run
                colls = [c for c in step_collectives(preset, [n], nodes, ranks_per_node, gathers=1,
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
            fixed[preset][name], per_element[preset][name] = a * 1e6, b * 1e9
    return fixed, per_element
