"""Launch census: what one call of each qsdp collective asks of the host, counted on CPU.

A training step on a GPU is host-bound when its collectives dispatch more work than the GPU
needs time to run. What a call dispatches does not depend on the device, so it can be counted
without one: each collective of :mod:`qsdp.comm` runs here, as rank ``rank`` of an emulated
``nodes x ranks_per_node`` world, and for each call the census counts

* ``torch``: torch operators that launch a kernel on a GPU (a ``TorchDispatchMode`` sees every
  operator; views, metadata and allocations launch none and are not counted);
* ``triton``: launches of qsdp's Triton kernels (:data:`qsdp.codecs.triton_kernels.launch_observers`);
* ``collectives``: the process-group calls, counted apart (their latency is the network's);
* ``syncs``: host reads of a tensor's value (``.item()``, ``bool(t)``, ``torch.equal``,
  ``.tolist()``, ``.cpu()``, ...), each a device sync on a GPU.

``launches`` is ``torch + triton``. The kernels are those a GPU runs: the census needs
``QSDP_TRITON_ON_CPU=1 TRITON_INTERPRET=1`` (read at import, see :mod:`qsdp.codecs.dispatch`), so
that the codec steps take the fused path under Triton's interpreter rather than the torch
reference. Counting makes it slow, not different: the same operators and launches, the same bytes.

The emulated world is one process: a process-group backend (``qsdp-census``) that delivers this
rank's own send buffer as every peer's (an all-to-all copies its input, an all-gather repeats
it, an all-reduce leaves the tensor as it is): the bytes differ from a real world's, the work
does not. It also hashes every buffer sent, which pins the wire bytes of a collective for fixed
inputs and seeds (tests/test_launch_census.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import sys
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..codecs.dispatch import use_triton
from ..comm.all_gather import DifferenceAllGather, QuantizedAllGather
from ..comm.difference import replica_layout
from ..comm.hsdp import ReplicaAllReduce
from ..comm.rank_alone import CompletedWork
from ..comm.reduce_scatter import QuantizedReduceScatter, grad_codec, pipeline_slices_bounds
from ..comm.topology import Topology
from ..comm.versions import ChangeTracker
from ..config import AUTO_PIPELINE_SLICES, PRESETS, QuantConfig

BACKEND = "qsdp-census"

# Operators that launch no kernel: allocations and metadata (views are told by ``is_view``).
_NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::lift_fresh", "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::set_", "aten::resize_",
    "aten::_reshape_alias", "aten::as_strided", "aten::view", "aten::_local_scalar_dense", "aten::equal",
    "aten::is_nonzero", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
}
# Operators that read a value on the host (a device sync on a GPU).
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}
# Host reads that reach no operator on a CPU tensor (the dispatcher cannot see them), wrapped
# while counting: the same list as the sync policy's tests.
_PY_READS = [
    (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"), (torch.Tensor, "__array__"),
    (torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
]


@dataclasses.dataclass
class Tally:
    """What the calls made while it was active dispatched (see the module doc)."""

    torch: Counter = dataclasses.field(default_factory=Counter)
    triton: Counter = dataclasses.field(default_factory=Counter)
    collectives: Counter = dataclasses.field(default_factory=Counter)
    syncs: Counter = dataclasses.field(default_factory=Counter)
    wire: Any = dataclasses.field(default_factory=hashlib.sha256)
    quiet: int = 0  # > 0 inside the emulated wire: its copies are no work of the rank's
    launch_signatures: list = dataclasses.field(default_factory=list)

    def counts(self) -> dict[str, int]:
        t, k = sum(self.torch.values()), sum(self.triton.values())
        return {"launches": t + k, "torch": t, "triton": k, "collectives": sum(self.collectives.values()),
                "syncs": sum(self.syncs.values())}


_ACTIVE: list[Tally] = []


def _active() -> Tally | None:
    return _ACTIVE[-1] if _ACTIVE and not _ACTIVE[-1].quiet else None


class _Dispatched(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tally = _active()
        if tally is not None:
            name = func._schema.name
            if name in _SYNC_OPS:
                tally.syncs[name] += 1
            elif not (func.is_view or name in _NO_KERNEL or name.startswith(("c10d::", "_c10d_functional::"))):
                tally.torch[name] += 1
        return func(*args, **(kwargs or {}))


def launch_signature(kernel: Any, args: tuple) -> tuple:
    """What Triton specializes a compiled variant of ``kernel`` on, for the positional ``args``
    of one launch (constexprs are passed by keyword): each argument's type and, unless it is in
    ``do_not_specialize``, its alignment and ``== 1``. Two launches with different signatures
    compile two variants (a JIT kernel on a GPU; the interpreter computes the same thing)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    fn = getattr(kernel, "fn", kernel)
    names = list(inspect.signature(fn).parameters)
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return tuple((n, native_specialize_impl(BaseBackend, a, False, n not in dns, True))
                 for n, a in zip(names, args))


@contextlib.contextmanager
def _observe_launch(kernel, grid, args, kwargs) -> Iterator[None]:
    """Count one launch; what runs it (Triton's interpreter copies the arguments to and from
    the host) is no work a GPU launch does on the host, and is not counted."""
    tally = _active()
    if tally is None:
        yield
        return
    name = getattr(kernel, "__name__", str(kernel))
    tally.triton[name] += 1
    tally.launch_signatures.append((name, launch_signature(kernel, args)))
    tally.quiet += 1
    try:
        yield
    finally:
        tally.quiet -= 1


@contextlib.contextmanager
def _py_reads(tally: Tally) -> Iterator[None]:
    saved = []
    for owner, name in _PY_READS:
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if _active() is tally and (caller == "qsdp" or caller.startswith("qsdp.")):
                tally.syncs[_name] += 1
            return _original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def counting() -> Iterator[Tally]:
    """Count what the calls inside dispatch (see the module doc)."""
    from ..codecs import triton_kernels

    tally = Tally()
    _ACTIVE.append(tally)
    triton_kernels.launch_observers.append(_observe_launch)
    try:
        with _py_reads(tally), _Dispatched():
            yield tally
    finally:
        triton_kernels.launch_observers.remove(_observe_launch)
        _ACTIVE.remove(tally)


# ----------------------------------------------------------------------------- the emulated wire


class CensusGroup(dist.ProcessGroup):
    """Rank ``rank`` of a group of ``size`` whose peers all send what this rank sends; each call
    is counted in the active :class:`Tally` and its send buffer hashed into ``wire``."""

    # False while the host's floor is timed (qsdp.bench.host_floor.collectives_move_nothing): a
    # collective is then only its call, as a launch is, and its bytes are the device's work.
    moves_data = True

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    @contextlib.contextmanager
    def _wire(self, name: str, *sent: torch.Tensor) -> Iterator[None]:
        tally = _ACTIVE[-1] if _ACTIVE else None
        if tally is None:
            yield
            return
        tally.collectives[name] += 1
        tally.quiet += 1
        try:
            tally.wire.update(name.encode())
            for t in sent:  # a grouped call's buffers one after another, as one buffer would hash
                tally.wire.update(t.detach().contiguous().view(torch.uint8).view(-1).numpy().tobytes())
            yield
        finally:
            tally.quiet -= 1

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        with self._wire("all_to_all", input):
            if CensusGroup.moves_data:
                output.copy_(input)
        return CompletedWork([output])

    # torch 2.13's name, which qsdp calls: defined here in Python as FSDP2's reduce-scatter and
    # gather are, so that no collective goes through the C++ base's dispatch back into Python
    # (a callback no real backend makes) and each costs the same call.
    all_to_all_single = alltoall_base

    def all_gather_single(self, output, input, opts=None):
        with self._wire("all_gather", input):
            if CensusGroup.moves_data:
                output.view(self.size(), -1).copy_(input.reshape(1, -1).clone())
        return CompletedWork([output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        with self._wire("all_gather", *inputs):
            if CensusGroup.moves_data:
                for output, sent in zip(outputs, inputs):
                    output.view(self.size(), -1).copy_(sent.reshape(1, -1).clone())
        return CompletedWork(list(outputs))

    def reduce_scatter_single(self, output, input, opts=None):
        with self._wire("reduce_scatter", input):
            if CensusGroup.moves_data:
                output.copy_(input.view(self.size(), -1)[self.rank()])
        return CompletedWork([output])

    _reduce_scatter_base = reduce_scatter_single

    def allreduce(self, tensors, opts=None):
        with self._wire("all_reduce", tensors[0]):
            pass
        return CompletedWork(tensors)

    def barrier(self, opts=None):
        return CompletedWork([])

    def getBackendName(self) -> str:
        return BACKEND


def _make_group(store, rank, size, timeout) -> CensusGroup:
    return CensusGroup(rank, size)


@contextlib.contextmanager
def emulated_world(nodes: int, ranks_per_node: int, rank: int = 0) -> Iterator[Topology]:
    """This process as group rank ``rank`` of ``nodes x ranks_per_node`` (torchrun numbering) on
    the census backend, with its intra- and inter-node subgroups; the world is destroyed after."""
    if dist.is_initialized():
        raise RuntimeError("the launch census needs a process without a default process group")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _make_group, devices=["cpu"])
    world = nodes * ranks_per_node
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world)
    try:
        topo = Topology.contiguous(nodes, ranks_per_node, rank, dist.group.WORLD)
        if nodes > 1 and ranks_per_node > 1:
            topo.intra_group = dist.new_group(list(topo.intra_ranks[topo.node]))
            topo.inter_group = dist.new_group(list(topo.inter_ranks[topo.local_rank]))
        yield topo
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the collectives

# ``gather_difference`` sends a difference at every call (a comm without a change tracker takes
# every gather for a new version); ``gather_difference_step`` is a training step's gathers, the
# first of which agrees on the changes over the group: the one host read a step makes there.
COLLECTIVES = ("reduce_scatter", "gather_direct", "gather_difference", "gather_difference_step", "hsdp_all_reduce")


def collective_kind(cfg: QuantConfig, collective: str, nodes: int, ranks_per_node: int) -> str | None:
    """How ``collective`` runs under ``cfg`` in this world (``None``: it is not quantized, it is
    FSDP2's own): ``one_level``, ``two_level``, ``direct``, ``full``, ``node`` or ``quantized``."""
    g, w, h = cfg.grads, cfg.weights, cfg.hsdp
    if collective == "reduce_scatter":
        if g.mode == "plain":
            return None
        if g.mode == "one_level" or nodes == 1 or ranks_per_node == 1:
            return "one_level"
        return "two_level"
    if collective == "gather_direct":
        return "direct" if w.mode == "direct" else None
    if collective in ("gather_difference", "gather_difference_step"):
        if w.mode != "difference":
            return None
        layout = replica_layout(w.replica, nodes, ranks_per_node)
        return None if layout == "exact" else layout
    if collective == "hsdp_all_reduce":
        return "quantized" if h.mode == "quantized" else None
    raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")


def _inputs(shard: int, world: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(world * shard, generator=gen).to(dtype)


def _difference_step_calls(cfg: QuantConfig, topo: Topology, shard: int, groups: int, calls: int,
                           dtype: torch.dtype) -> list[Tally]:
    """The tallies of a training step's weight-difference gathers, ``calls`` steps after the first."""
    tallies: list[Tally] = []
    # A training step's gathers: an optimizer step changed every group's parameters, so the
    # first gather agrees on the changes over the group (one host read for all the groups).
    tracker = ChangeTracker()
    comms = [DifferenceAllGather(cfg, topo, i, tracker) for i in range(groups)]
    params = [_inputs(shard, 1, 1000 * i, dtype) for i in range(groups)]
    for i, (comm, p) in enumerate(zip(comms, params)):
        comm.track([p], f"group {i}")
    for c in range(calls + 1):
        if c > 0:
            tracker.before_optimizer_step()
            for i, p in enumerate(params):
                p.copy_(_inputs(shard, 1, 1000 * i + c, dtype))
            tracker.after_optimizer_step()
        for i, comm in enumerate(comms):
            tally = _gather_call(comm, topo, params[i], dtype)
            if c > 0:
                tallies.append(tally)
    return tallies


def _gather_call(comm: Any, topo: Topology, values: torch.Tensor, dtype: torch.dtype) -> Tally:
    """One gather of ``values`` (this rank's shard) through ``comm``, counted, with its output's
    bytes hashed."""
    shard = values.numel()
    out = torch.empty(topo.world_size * shard, dtype=dtype)
    shard_in = out.view(topo.world_size, shard)[topo.rank]
    shard_in.copy_(values)
    with counting() as tally:
        comm(out, shard_in, topo.group)
    tally.wire.update(out.view(torch.uint8).numpy().tobytes())
    return tally


def _run_calls(cfg: QuantConfig, collective: str, topo: Topology, shard: int, groups: int, calls: int,
               dtype: torch.dtype) -> list[Tally]:
    """``calls`` calls of ``collective`` on each of ``groups`` FSDP groups (comm ids 0..groups-1),
    a :class:`Tally` per call (warm-up calls excluded: a difference gather's first call sends
    exact values)."""
    world = topo.world_size
    tallies: list[Tally] = []
    if collective == "reduce_scatter":
        comms = [QuantizedReduceScatter(cfg, topo, i) for i in range(groups)]
        for c in range(calls):
            for i, comm in enumerate(comms):
                grads = _inputs(shard, world, 1000 * i + c, dtype)
                out = torch.empty(shard, dtype=dtype)
                with counting() as tally:
                    comm(out, grads, topo.group, dist.ReduceOp.AVG)
                tally.wire.update(out.view(torch.uint8).numpy().tobytes())
                tallies.append(tally)
        return tallies
    if collective in ("gather_direct", "gather_difference"):
        cls = QuantizedAllGather if collective == "gather_direct" else DifferenceAllGather
        comms = [cls(cfg, topo, i) for i in range(groups)]
        for c in range(calls + 1):
            for i, comm in enumerate(comms):
                tally = _gather_call(comm, topo, _inputs(shard, 1, 1000 * i + c, dtype), dtype)
                if c > 0:
                    tallies.append(tally)
        return tallies
    if collective == "gather_difference_step":
        return _difference_step_calls(cfg, topo, shard, groups, calls, dtype)
    if collective == "hsdp_all_reduce":
        comms = [ReplicaAllReduce(cfg, topo.group, i) for i in range(groups)]
        for c in range(calls):
            for i, comm in enumerate(comms):
                x = _inputs(shard, 1, 1000 * i + c, torch.float32)
                with counting() as tally:
                    total = comm(x)
                tally.wire.update(total.view(torch.uint8).numpy().tobytes())
                tallies.append(tally)
        return tallies
    raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One census row: ``collective`` under ``preset`` (a name or a config) in a ``nodes x
    ranks_per_node`` world, as rank ``rank``, ``groups`` FSDP groups of ``shard`` elements per
    rank, ``calls`` calls each. ``slices``: the two-level reduce-scatter's rounding slices
    (``None``: the preset's), their exchanges grouped as ``pipeline_slices="auto"`` groups them
    (where the host moves the bytes, as here, all in one exchange per hop); with ``pipelined``,
    ``pipeline_slices=slices``: each slice in exchanges of its own (SDP4Bit's pipeline)."""

    preset: Any
    collective: str
    nodes: int = 2
    ranks_per_node: int = 2
    shard: int = 1 << 16
    slices: int | None = None
    pipelined: bool = False
    groups: int = 1
    calls: int = 2
    rank: int = 0
    dtype: torch.dtype = torch.bfloat16
    host: bool = False  # also the host's floor of a call (qsdp.bench.host_floor; the fused path only)

    def config(self) -> QuantConfig:
        cfg = PRESETS[self.preset] if isinstance(self.preset, str) else self.preset
        g = cfg.grads
        if self.slices is not None and self.pipelined:
            g = dataclasses.replace(g, pipeline_slices=self.slices, pipeline_min_slice=1)
        elif self.slices is not None:
            if not 1 <= self.slices <= AUTO_PIPELINE_SLICES:
                raise ValueError(f"slices={self.slices} must be 1..{AUTO_PIPELINE_SLICES} without pipelined=True")
            # "auto" rounds a row in fewer than 8 slices where a slice would be shorter than
            # pipeline_min_slice: set it so that this row gets exactly ``slices``.
            lp = -(-self.shard // 128) * 128
            g = dataclasses.replace(g, pipeline_slices="auto", pipeline_min_slice=max(1, lp // self.slices))
        return dataclasses.replace(cfg, grads=g, local_world_size=self.ranks_per_node)

    @property
    def name(self) -> str:
        return self.preset if isinstance(self.preset, str) else self.preset.name


def run_case(case: Case) -> tuple[dict[str, Any], list[Tally]]:
    """The census of ``case``: its row (counts per call, the largest over its calls; the sha256
    of every call's wire bytes and result) and each call's :class:`Tally`."""
    cfg = case.config()
    kind = collective_kind(cfg, case.collective, case.nodes, case.ranks_per_node)
    row: dict[str, Any] = {"preset": case.name, "collective": case.collective, "kind": kind,
                           "world": f"{case.nodes}x{case.ranks_per_node}", "shard": case.shard,
                           "slices": _rounding_slices(cfg, kind, case.shard, case.dtype),
                           "groups": case.groups}
    if kind is None:
        return row, []
    with emulated_world(case.nodes, case.ranks_per_node, case.rank) as topo:
        tallies = _run_calls(cfg, case.collective, topo, case.shard, case.groups, case.calls, case.dtype)
    per_call = [t.counts() for t in tallies]
    row.update({k: max(c[k] for c in per_call) for k in per_call[0]})
    row["fused"] = fused_path()
    wire = hashlib.sha256()
    for t in tallies:
        wire.update(t.wire.digest())
    row["wire_sha256"] = wire.hexdigest()
    if case.host and row["fused"]:
        with emulated_world(case.nodes, case.ranks_per_node, case.rank) as topo:
            row.update(host_floor(cfg, case.collective, topo, case.shard, case.dtype))
    return row, tallies


def _steady_calls(cfg: QuantConfig, collective: str, topo: Topology, shard: int,
                  dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """``{"qsdp": a steady call of collective's comm object, "fsdp2": FSDP2's own collective of the
    same group, size and dtype}``, each called again and again on the same inputs."""
    from ..comm.collectives import all_gather_flat, reduce_scatter_flat

    world = topo.world_size
    if collective == "reduce_scatter":
        comm = QuantizedReduceScatter(cfg, topo, 1)
        grads, out, base_out = _inputs(shard, world, 1, dtype), torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
        return {"qsdp": lambda: comm(out, grads, topo.group, dist.ReduceOp.AVG),
                "fsdp2": lambda: reduce_scatter_flat(base_out, grads, dist.ReduceOp.SUM, topo.group)}
    if collective == "hsdp_all_reduce":
        ar = ReplicaAllReduce(cfg, topo.group, 1)
        x, total = _inputs(shard, 1, 1, torch.float32), torch.empty(shard)

        def all_reduce() -> None:
            total.copy_(x)
            dist.all_reduce(total, group=topo.group)

        return {"qsdp": lambda: ar(x), "fsdp2": all_reduce}
    if collective == "gather_difference_step":
        # a training step's gathers: an optimizer step between every two
        tracker = ChangeTracker()
        comm = DifferenceAllGather(cfg, topo, 1, tracker)
    else:
        comm = (QuantizedAllGather if collective == "gather_direct" else DifferenceAllGather)(cfg, topo, 1)
    values = _inputs(shard, 1, 1, dtype)
    out, base_out = torch.empty(world * shard, dtype=dtype), torch.empty(world * shard, dtype=dtype)
    mine = out.view(world, shard)[topo.rank]
    if collective == "gather_difference_step":
        comm.track([values], "group 1")

    base_mine = base_out.view(world, shard)[topo.rank]
    step = collective == "gather_difference_step"

    def gather() -> None:
        if step:
            tracker.before_optimizer_step()
            values.add_(0)
            tracker.after_optimizer_step()
        mine.copy_(values)  # FSDP2 copies the shard into the gathered buffer before it calls
        comm(out, mine, topo.group)

    def fsdp2_gather() -> None:
        # FSDP2's own step around its collective, as around qsdp's: the optimizer's step (the
        # step's gathers), the copy of the shard into the gathered buffer, the gather in place
        if step:
            values.add_(0)
        base_mine.copy_(values)
        all_gather_flat(base_out, base_mine, topo.group)

    return {"qsdp": gather, "fsdp2": fsdp2_gather}


def host_floor(cfg: QuantConfig, collective: str, topo: Topology, shard: int, dtype: torch.dtype,
               repeats: int = 5) -> dict[str, Any]:
    """The host's floor of a steady call of ``collective`` (:mod:`qsdp.bench.host_floor`):
    ``host_us`` and ``fsdp2_us`` (minimum of ``repeats`` runs of 25 calls), their ``host_ratio``,
    ``py_calls`` and ``qsdp_calls``."""
    from . import host_floor as hf

    with hf.quiet_cpu(), hf.launches_do_nothing(), hf.collectives_move_nothing(CensusGroup):
        fns = _steady_calls(cfg, collective, topo, shard, dtype)
        us = hf.min_us(fns, repeats=repeats)
        calls, ours = hf.python_calls(fns["qsdp"])
    return {"host_us": round(us["qsdp"], 1), "fsdp2_us": round(us["fsdp2"], 1),
            "host_ratio": round(us["qsdp"] / us["fsdp2"], 2), "py_calls": calls, "qsdp_calls": ours}


def _rounding_slices(cfg: QuantConfig, kind: str | None, shard: int, dtype: torch.dtype) -> int | None:
    """The rounding slices of a two-level reduce-scatter of ``shard`` elements per rank."""
    if kind != "two_level":
        return None
    g = cfg.grads
    hop1 = grad_codec(g, g.bits_intra, dtype)
    unit = math.lcm(hop1.unit, grad_codec(g, g.bits_inter, torch.float32).unit)
    lp = hop1.padded_len(-(-shard // unit) * unit)
    return len(pipeline_slices_bounds(lp, hop1, g.rounding_slices, g.pipeline_min_slice))


def fused_path() -> bool:
    """Whether codec steps on CPU tensors take the fused Triton path (the one a GPU takes)."""
    return use_triton(torch.empty(0))


def default_cases() -> list[Case]:
    """Every quantized collective of every preset, in a 2 x 2 world."""
    return [Case(p, c) for p in PRESETS for c in COLLECTIVES
            if collective_kind(PRESETS[p], c, 2, 2) is not None]


def census(cases: list[Case] | None = None, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The census rows of ``cases`` (default: :func:`default_cases`)."""
    rows = []
    for case in cases if cases is not None else default_cases():
        if progress is not None:
            progress(f"{case.preset} {case.collective}")
        rows.append(run_case(case)[0])
    return rows


def keep_best_host_floors(cases: list[Case], rows: list[dict[str, Any]], runs: int,
                          progress: Callable[[str], None] | None = None) -> None:
    """Time the host floor of each of ``cases`` (whose census ``rows`` hold one already)
    ``runs - 1`` more times, every case once before the next time (as separate runs of the
    command would), and keep in its row the minimum of ``host_us`` and of ``fsdp2_us`` (a loaded
    machine only ever adds time), ``host_ratio`` their quotient."""
    for k in range(2, runs + 1):
        for case, row in zip(cases, rows):
            if "host_us" not in row:
                continue
            if progress is not None:
                progress(f"host floor {k}/{runs}: {case.preset} {case.collective}")
            with emulated_world(case.nodes, case.ranks_per_node, case.rank) as topo:
                again = host_floor(case.config(), case.collective, topo, case.shard, case.dtype)
            row["host_us"] = min(row["host_us"], again["host_us"])
            row["fsdp2_us"] = min(row["fsdp2_us"], again["fsdp2_us"])
            row["host_ratio"] = round(row["host_us"] / row["fsdp2_us"], 2)


def host_floor_note(runs: int) -> str:
    """How the ``host_us`` and ``fsdp2_us`` of a result were taken (its ``meta``)."""
    from .host_floor import CALLS, REPEATS

    return (f"host_us and fsdp2_us: the minimum over {runs} run(s) of every case (each the minimum of {REPEATS} "
            f"runs of {CALLS} calls); host_ratio their quotient. While a floor is timed the emulated collectives "
            "move no bytes (a GPU host only enqueues them), for qsdp's collectives and FSDP2's alike. fsdp2_us of "
            "a gather: FSDP2's copy of the shard into the gathered buffer and its gather in place (with the "
            "optimizer's step between a training step's gathers), as qsdp's gather is timed")


# ----------------------------------------------------------------------------- command line

_COLUMNS = ("preset", "collective", "kind", "world", "slices", "launches", "torch", "triton", "collectives", "syncs",
            "host_us", "fsdp2_us", "host_ratio", "py_calls", "qsdp_calls")


def format_table(result: dict[str, Any]) -> str:
    from ..text_table import aligned

    lines = [_COLUMNS]
    for row in result["rows"]:
        lines.append(tuple("-" if row.get(c) is None else str(row[c]) for c in _COLUMNS))
    path = "the fused path (Triton kernels, interpreted)" if result["fused"] else "the torch reference"
    title = (f"per call of each collective, rank {result['rank']}, {result['shard']} elements per rank, "
             f"{path}; launches = torch + triton, collectives apart")
    notes = ["host_us: microseconds a call with every kernel launch a no-op, minimum of 5 runs of 25 calls; "
             "fsdp2_us: FSDP2's own collective of the same size, same run; py_calls (qsdp_calls): Python "
             "function calls a call makes (qsdp's own)"] if any("host_us" in r for r in result["rows"]) else []
    return "\n".join([title, *aligned(lines, rule=True), *notes])


def _world(text: str) -> tuple[int, int]:
    import argparse

    try:
        nodes, m = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world={text!r} must be NODESxRANKS, e.g. 2x2") from None
    if nodes < 1 or m < 1:
        raise argparse.ArgumentTypeError(f"--world={text!r} needs at least one node and one rank per node")
    return nodes, m


def _parser():
    from ..usage import UsageParser, save_path

    parser = UsageParser(prog="qsdp bench census", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=[p for p in PRESETS if p != "fsdp"], choices=list(PRESETS))
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=list(COLLECTIVES))
    parser.add_argument("--world", type=_world, default=(2, 2), help="NODESxRANKS of the emulated world (2x2)")
    parser.add_argument("--rank", type=int, default=0, help="the rank played")
    parser.add_argument("--shard", type=int, default=1 << 16, help="elements per rank of each group")
    parser.add_argument("--slices", type=int, default=None,
                        help="the two-level reduce-scatter's rounding slices, 1..8 (default: the preset's)")
    parser.add_argument("--groups", type=int, default=1, help="FSDP groups, each called in turn")
    parser.add_argument("--reference", action="store_true",
                        help="count the torch reference (what a CPU runs) instead of the fused Triton path")
    parser.add_argument("--no-host-time", action="store_true",
                        help="leave out the host's floor of a call (host_us, fsdp2_us, py_calls; the fused path only)")
    parser.add_argument("--runs", type=int, default=1,
                        help="time each host floor this many times, every case once before the next time, and "
                             "keep each figure's minimum (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    import os
    import subprocess

    from ..codecs.dispatch import triton_available
    from ..results import emit, meta

    parser = _parser()
    args = parser.parse_args(argv)
    nodes, m = args.world
    if not 0 <= args.rank < nodes * m:
        parser.error(f"--rank={args.rank} is not a rank of a {nodes}x{m} world")
    if args.shard < 1 or args.groups < 1 or args.runs < 1:
        parser.error("--shard, --groups and --runs must be at least 1")
    if args.slices is not None and not 1 <= args.slices <= AUTO_PIPELINE_SLICES:
        parser.error(f"--slices={args.slices} must be 1..{AUTO_PIPELINE_SLICES}")
    want_fused = not args.reference
    if want_fused != fused_path():
        if want_fused and not triton_available():
            parser.error("the fused path needs triton (pip install 'qsdp[gpu]'); --reference counts the torch one")
        # Which path the codecs take is read once, at import: run again with it switched.
        env = dict(os.environ)
        if want_fused:
            env.update(TRITON_INTERPRET="1", QSDP_TRITON_ON_CPU="1")
            env.pop("QSDP_DISABLE_TRITON", None)
        else:
            env["QSDP_DISABLE_TRITON"] = "1"
        return subprocess.call([sys.executable, "-m", "qsdp.bench.census", *(argv if argv is not None else sys.argv[1:])],
                               env=env)
    cases = [Case(p, c, nodes=nodes, ranks_per_node=m, shard=args.shard, slices=args.slices, groups=args.groups,
                  rank=args.rank, host=not args.no_host_time)
             for p in args.presets for c in args.collectives
             if collective_kind(PRESETS[p], c, nodes, m) is not None]
    progress = lambda what: print(f"census: {what}", file=sys.stderr)  # noqa: E731
    rows = census(cases, progress=progress)
    keep_best_host_floors(cases, rows, args.runs, progress)
    extra = {}
    if fused_path():
        import triton

        extra["triton"] = triton.__version__
    if any("host_us" in row for row in rows):
        extra["runs"] = host_floor_note(args.runs)
    result = {"fused": fused_path(), "rank": args.rank, "shard": args.shard, "rows": rows,
              "meta": meta("census", argv, "cpu, one process emulating the world"
                           + (", Triton interpreter" if fused_path() else ""), **extra)}
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


if __name__ == "__main__":
    sys.exit(main())
