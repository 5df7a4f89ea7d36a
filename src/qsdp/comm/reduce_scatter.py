"""Gradient reduce-scatters with FSDP2's custom comm interface.

FSDP2 calls ``comm(output_tensor, input_tensor, group, op)``: ``input_tensor`` is the flat
unsharded gradient ``[world * shard]`` (chunk ``r`` belongs to rank ``r``), ``output_tensor``
this rank's ``[shard]``. ``op`` is ``SUM`` or ``AVG``; the division for ``AVG`` is done here, in
one place, after the fp32 sum (it equals the plain reduce-scatter's average exactly when
quantization is off and the sum is exact).

The quantized versions move packed bytes with all-to-all and reduce in fp32 on the receiver.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..codecs.dispatch import disabled
from ..config import GradComm
from .base import GradReduceScatter
from .collectives import all_to_all, backend_of
from .meter import peer_entries
from .row_layout import RowLayout
from .wire import RowCodec, SliceRun, _pad_cols, _padding_from, _tk, launch_keys, one_launch, recording, takes_keys


def _divisor(op: Any, world: int) -> int:
    if op == dist.ReduceOp.SUM:
        return 1
    if op == dist.ReduceOp.AVG:
        return world
    raise RuntimeError(
        f"qsdp reduce-scatter supports ReduceOp.SUM and ReduceOp.AVG, got {op!r} (a custom "
        "gradient divide factor); leave FSDP2's gradient divide factor at its default"
    )


class PlainReduceScatter(GradReduceScatter):
    """The ``fsdp`` preset: FSDP2's own reduce-scatter, metered."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        self.check_group(group)
        self.plain(output_tensor, input_tensor, group, op)
        return None


def grad_codec(g: GradComm, bits: int, raw_dtype: torch.dtype) -> RowCodec:
    if not g.quantize:
        return RowCodec(bits=None, raw_dtype=raw_dtype)
    return RowCodec(bits=bits, group_size=g.group_size, symmetric=g.symmetric,
                    rounding=g.rounding, hadamard_block=g.hadamard_block)


class QuantizedReduceScatter(GradReduceScatter):
    """One- or two-level quantized reduce-scatter (QSDP; SDP4Bit TLq / TLq-HS).

    One level: every rank quantizes the ``world`` chunks of its gradient once, one all-to-all
    delivers each chunk to its owner, who dequantizes and sums in fp32.

    Two levels (``D`` nodes x ``M`` ranks): optional blockwise Hadamard; ``bits_intra``
    quantization; an all-to-all inside the node delivers to local rank ``l`` the chunks of every
    node's rank ``l``; it dequantizes, sums the ``M`` contributions, requantizes to
    ``bits_inter`` (still in the Hadamard domain); an all-to-all among the ``D`` ranks with local
    rank ``l`` delivers each node's partial sum to its owner, who dequantizes, sums and inverts
    the Hadamard transform. The chunk is rounded in ``pipeline_slices`` slices (8 for
    ``"auto"``: ``GradComm.rounding_slices``), each with its own seeds. Their exchanges run
    asynchronously, one per slice, so that quantizing slice ``k+1`` overlaps the transfer of
    slice ``k``; with ``"auto"`` consecutive slices' encoded columns travel side by side in one
    exchange until it moves ``pipeline_min_bytes`` (:func:`exchange_groups`), and where no engine
    is free to overlap (:func:`pipelines_exchanges`: gloo, CPU tensors) all of them in one
    exchange per hop: the same bytes and the same result. On the fused path each codec step of
    an exchange is one kernel launch for all its slices (:class:`~qsdp.comm.wire.SliceRun`).
    With one node (or one rank per node) a single hop remains: ``bits_intra`` inside a node,
    ``bits_inter`` across nodes.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        self.check_group(group)
        world, s = self.topology.world_size, output_tensor.numel()
        if op is self._op:
            divisor = self._op_divisor  # the op of the last call (ReduceOp's == is a pybind call)
        else:
            divisor = _divisor(op, world)
            self._op, self._op_divisor = op, divisor
        if not self.config.quantizes_shard(s):
            self.plain(output_tensor, input_tensor, group, op)
            return None
        self.calls += 1
        # Everything fixed by the shapes, dtypes, groups and config (and, in a row mixing TP's
        # kinds, by the spans as they are now) is planned at the first call.
        layouts, device = self.layouts, input_tensor.device
        key = (s, input_tensor.dtype, output_tensor.dtype, device, layouts.plan_key() if layouts.mixed else ())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(input_tensor.view(world, s), output_tensor)
        # The last kernel divides, casts into FSDP2's output and watches for NaN/Inf itself
        # (direct: where the plan says so and the kernels were not switched off since, by
        # QSDP_DISABLE_TRITON); otherwise the fp32 sum is divided and watched by torch.
        direct = plan.direct and not disabled()
        flag = self.kernel_flag(device) if direct else None
        # A steady call launches its first call's kernels again with its own tensors and seeds
        # (plan.launches: where every step took one launch and the tensors are contiguous).
        launches = plan.launches.get(divisor)
        if launches is not None and direct and input_tensor.is_contiguous() and output_tensor.is_contiguous() \
                and input_tensor.numel() == world * s:
            if plan.runs is None:
                self._one_hop_again(input_tensor, group, plan, launches, output_tensor, flag)
            else:
                self._two_hops_again(input_tensor, plan, launches, output_tensor, flag)
            return None
        x = input_tensor.view(world, s)
        if plan.runs is None:
            total = self._one_hop(x, group, plan, direct, output_tensor, divisor, flag)
        else:
            total = self._two_hops(x, plan, direct, output_tensor, divisor, flag)
        if direct:
            return None
        if divisor != 1:
            # the fp32 quotient cast into FSDP2's output as copy_ would, in one kernel
            torch.div(total, divisor, out=output_tensor)
        else:
            output_tensor.copy_(total)
        self.watch(output_tensor)
        return None

    _op: Any = None  # the last call's op and its divisor
    _op_divisor: int = 1

    def _plan(self, x: torch.Tensor, output: torch.Tensor) -> "OneHopPlan | TwoHopPlan":
        topo, g = self.topology, self.config.grads
        m, d = topo.ranks_per_node, topo.nodes
        if g.mode == "one_level":
            return OneHopPlan.build(self, x, output, grad_codec(g, g.bits, x.dtype), inter_only=False)
        if d == 1 or m == 1:
            bits = g.bits_intra if d == 1 else g.bits_inter
            return OneHopPlan.build(self, x, output, grad_codec(g, bits, x.dtype), inter_only=d > 1)
        return TwoHopPlan.build(self, x, output)

    def _one_hop(self, x: torch.Tensor, group, plan: "OneHopPlan", direct: bool, output: torch.Tensor,
                 divisor: int, flag: torch.Tensor | None) -> torch.Tensor | None:
        codec, layout = plan.codec, plan.layout
        # The first call's launches are kept for the later calls where both steps are one
        # launch each and the decoding writes FSDP2's output (direct).
        with recording(direct) as encoded:
            # A group mixing TP-replicated and TP-sharded parameters is encoded from a copy of its
            # gradient in the codec's order (row_layout); any other group from the gradient itself.
            send = codec.encode(x if layout.identity else layout.expand(x), seed=plan.seeds(self.calls)[0])
        recv = torch.empty_like(send)
        all_to_all(recv, send, group)
        self.byte_meter.add(plan.meter)
        if direct:
            with recording(True) as decoded:
                codec.decode_sum_finished_into(recv, layout.wire_length, output, divisor=divisor, flag=flag)
            launches = (one_launch(encoded), one_launch(decoded))
            if layout.identity and None not in launches and takes_keys(plan.keys, launches[0]):
                plan.launches[divisor] = launches
            return None
        return layout.contract(codec.decode_sum(recv, layout.wire_length, finish=True))

    def _one_hop_again(self, x: torch.Tensor, group, plan: "OneHopPlan", launches: tuple, output: torch.Tensor,
                       flag: torch.Tensor | None) -> None:
        """:meth:`_one_hop` of a steady call: its two launches and its exchange (``x`` the flat
        gradient, the kernels reading it by the rows the first call's launch was made for)."""
        tk = _tk()
        send = torch.empty(*plan.send_shape, dtype=torch.uint8, device=x.device)
        if plan.used is not None:
            send[:, plan.used:].zero_()  # each row's 4-byte padding, as the encoding zeroes it
        tk.quantize_again(launches[0], x, send, plan.keys(self.calls)[0])
        recv = torch.empty_like(send)
        all_to_all(recv, send, group)
        self.byte_meter.add(plan.meter)
        tk.dequantize_again(launches[1], recv, output, None, 0, flag)

    def _two_hops(self, x: torch.Tensor, plan: "TwoHopPlan", direct: bool, output: torch.Tensor, divisor: int,
                  flag: torch.Tensor | None) -> torch.Tensor | None:
        topo = self.topology
        layout = plan.layout
        order = topo.exchange_index(x.device)
        # The rounding slices (their bounds and seeds fix the result) travel in runs, one
        # exchange per hop each: one per slice when pipelined, else all of them in one. Each
        # codec step of a run is one launch on the fused path (the slices a grid axis, each with
        # its own seed); the Hadamard transform (blockwise, and every slice is whole blocks) is
        # fused into hop 1's quantization, its inverse into hop 2's decoding, and with
        # direct the division, the cast into FSDP2's output and the watch too. Those
        # launches are kept for the later calls (:meth:`_two_hops_again`).
        out = output if direct else torch.empty(plan.lp, dtype=torch.float32, device=x.device)
        prefix1, prefix2 = plan.seeds(self.calls)
        runs = plan.runs
        learned: list[list] = [[None, None, None] for _ in runs]

        def hop1(i: int) -> tuple[torch.Tensor, Any]:
            with recording(direct) as launches:
                sent = self._intra_exchange(x, plan, runs[i], order, prefix1)
            learned[i][0] = one_launch(launches)
            return sent

        def hop2(i: int, recv: torch.Tensor) -> tuple[torch.Tensor, Any]:
            with recording(direct) as launches:
                sent = self._inter_exchange(recv, plan, runs[i], prefix2)
            learned[i][1] = one_launch(launches)
            return sent

        def decode(i: int, recv2: torch.Tensor) -> None:
            if not direct:
                plan.hop2.decode_sum_slices(recv2, runs[i], out)
                return
            with recording(True) as launches:
                plan.hop2.decode_sum_slices(recv2, runs[i], out, divisor=divisor, flag=flag)
            learned[i][2] = one_launch(launches)

        _pipelined(len(runs), hop1, hop2, decode)
        if direct and all(None not in run for run in learned) \
                and all(takes_keys(plan.keys, run[0], run[1]) for run in learned):
            plan.launches[divisor] = tuple(tuple(run) for run in learned)
        return None if direct else layout.contract(out)

    def _two_hops_again(self, x: torch.Tensor, plan: "TwoHopPlan", launches: tuple, output: torch.Tensor,
                        flag: torch.Tensor | None) -> None:
        """:meth:`_two_hops` of a steady call: each run's three launches and two exchanges in the
        same order (``x`` the flat gradient; each run's kernels read from its first column on)."""
        tk = _tk()
        topo = self.topology
        intra, inter = topo.intra_group, topo.inter_group
        key1, key2 = plan.keys(self.calls)
        if len(launches) == 1:
            # One run (every slice in one exchange a hop): nothing to stagger, one step after another.
            encode, requantize, decode_out = launches[0]
            device = x.device
            send = torch.empty(*plan.shape1[0], dtype=torch.uint8, device=device)
            tk.quantize_again(encode, x, send, key1, None, plan.order)
            recv = torch.empty_like(send)
            all_to_all(recv, send, intra)
            send = torch.empty(*plan.shape2[0], dtype=torch.uint8, device=device)
            tk.dequantize_again(requantize, recv, None, send, key2)
            recv = torch.empty_like(send)
            all_to_all(recv, send, inter)
            self.byte_meter.add(plan.meter12)
            tk.dequantize_again(decode_out, recv, output, None, 0, flag)
            return
        runs, order, device, meter = plan.runs, plan.order, x.device, self.byte_meter

        def hop1(i: int) -> tuple[torch.Tensor, Any]:
            start = runs[i].start
            send = torch.empty(*plan.shape1[i], dtype=torch.uint8, device=device)
            tk.quantize_again(launches[i][0], x if start == 0 else x[start:], send, key1, None, order)
            recv = torch.empty_like(send)
            work = all_to_all(recv, send, intra, async_op=True)
            meter.add(plan.meter1[runs[i]])
            return recv, work

        def hop2(i: int, recv: torch.Tensor) -> tuple[torch.Tensor, Any]:
            send = torch.empty(*plan.shape2[i], dtype=torch.uint8, device=device)
            tk.dequantize_again(launches[i][1], recv, None, send, key2)
            recv2 = torch.empty_like(send)
            work = all_to_all(recv2, send, inter, async_op=True)
            meter.add(plan.meter2[runs[i]])
            return recv2, work

        def decode(i: int, recv2: torch.Tensor) -> None:
            start = runs[i].start
            tk.dequantize_again(launches[i][2], recv2, output if start == 0 else output[start:], None, 0, flag)

        _pipelined(len(runs), hop1, hop2, decode)

    def _intra_exchange(self, x: torch.Tensor, plan: "TwoHopPlan", run: SliceRun, order: torch.Tensor,
                        prefix: int) -> tuple[torch.Tensor, Any]:
        """Hop 1 of the slices of ``run``: each encoded with its own seed into its columns of one
        send buffer (rows in destination-major order: :func:`destination_major`), one
        asynchronous all-to-all inside the node."""
        topo = self.topology
        send = torch.empty(x.shape[0], plan.nbytes1[run], dtype=torch.uint8, device=x.device)
        plan.hop1.encode_slices(x, run, prefix=prefix, out=send, order=order,
                                layout=None if plan.layout.identity else plan.layout)
        recv = torch.empty_like(send)
        work = all_to_all(recv, send, topo.intra_group, async_op=True)
        self.byte_meter.add(plan.meter1[run])
        return recv, work

    def _inter_exchange(self, recv: torch.Tensor, plan: "TwoHopPlan", run: SliceRun,
                        prefix: int) -> tuple[torch.Tensor, Any]:
        """Hop 2 of the slices of ``run``: each one's columns of the intra-node receive buffer
        summed and requantized with its own seed into its columns of one send buffer, one
        asynchronous all-to-all across nodes."""
        topo = self.topology
        m, d = topo.ranks_per_node, topo.nodes
        send = torch.empty(d, plan.nbytes2[run], dtype=torch.uint8, device=recv.device)
        plan.hop1.decode_sum_encode_slices(recv, run, sources=m, codec=plan.hop2, prefix=prefix, out=send)
        recv2 = torch.empty_like(send)
        work = all_to_all(recv2, send, topo.inter_group, async_op=True)
        self.byte_meter.add(plan.meter2[run])
        return recv2, work


def _pipelined(n: int, hop1: Callable[[int], tuple], hop2: Callable[[int, torch.Tensor], tuple],
               decode: Callable[[int, torch.Tensor], None]) -> None:
    """The two-level exchanges of ``n`` runs of rounding slices, staggered: run ``i``'s hop 1
    (``hop1(i)``: its receive buffer and the exchange's work) goes out while run ``i - 1``'s
    hop 2 (``hop2(i - 1, received)``) and run ``i - 2``'s decoding (``decode(i - 2,
    received)``) follow, each once the exchange before it is done."""
    stage1: list = [None] * n
    stage2: list = [None] * n
    for step in range(n + 2):
        if step < n:
            stage1[step] = hop1(step)
        i = step - 1
        if 0 <= i < n:
            recv, work = stage1[i]
            work.wait()
            stage1[i] = None
            stage2[i] = hop2(i, recv)
        i = step - 2
        if 0 <= i < n:
            recv2, work2 = stage2[i]
            work2.wait()
            stage2[i] = None
            decode(i, recv2)


@dataclass(frozen=True)
class OneHopPlan:
    """What a one-hop quantized reduce-scatter of one gradient shape does, fixed by its config,
    sizes and group: the codec, the row layout, the meter's entry (bytes, elements, intra and
    inter peers) and whether the decoding kernel writes FSDP2's output itself (``direct``)."""

    codec: RowCodec
    layout: RowLayout
    meter: tuple  # the meter's entries (ByteMeter.add)
    direct: bool
    # The send buffer's shape, and where each row's 4-byte padding starts (None: there is none).
    # (Steady calls pass shapes as separate ints: torch.empty parses a tuple about 0.4 us slower.)
    send_shape: tuple[int, int] = (0, 0)
    used: int | None = None
    # {divisor: (encoding, decoding)}: the launches of the first call with that divisor, where
    # both were one launch (kernels.Launch); the later calls launch them again.
    launches: dict = dataclasses.field(default_factory=dict)
    runs: None = None  # (a two-hop plan's rounding slices)
    seeds: Any = None  # the encoding's seed of each call (rng.CallSeeds)
    keys: Any = None  # the same as its launch takes it (wire.launch_keys; where direct)

    @classmethod
    def build(cls, comm: "QuantizedReduceScatter", x: torch.Tensor, output: torch.Tensor, codec: RowCodec,
              inter_only: bool) -> "OneHopPlan":
        world, s = x.shape
        layout = comm.layouts.get(s, codec.unit, x.device)
        intra, inter = comm.topology.peers()
        nbytes = codec.row_nbytes(layout.wire_length)
        probe = torch.empty(0, dtype=torch.uint8, device=x.device)
        direct = (layout.identity and codec._fused(probe) and output.is_contiguous()
                  and output.dtype in (torch.float32, torch.bfloat16, torch.float16)
                  and (not codec.hadamard_block or _fuses_hadamard(codec)))
        meter = peer_entries("grads", nbytes, s, 0 if inter_only else intra, inter)
        seeds = comm.call_seeds((comm.topology.rank, 3))
        return cls(codec, layout, meter, direct, (world, nbytes), _padding_from(codec, layout.wire_length),
                   seeds=seeds, keys=launch_keys(seeds, codec.rounding) if direct else None)


def _fuses_hadamard(codec: RowCodec) -> bool:
    from ..codecs.triton_kernels import fuses_hadamard

    return fuses_hadamard(codec.group_size, codec.hadamard_block)


@dataclass(frozen=True)
class TwoHopPlan:
    """What a two-level reduce-scatter of one gradient shape does, fixed by its config, sizes
    and groups: the codecs of both hops, the row layout, the padded row length ``lp``, the
    runs of rounding slices that travel together, and the real (not padding) elements of each."""

    hop1: RowCodec
    hop2: RowCodec
    layout: RowLayout
    lp: int
    runs: tuple[SliceRun, ...]
    real: dict
    # Per run: the send buffers' widths and the meter's entries of both hops; whether hop 2's
    # decoding writes FSDP2's output itself (divided, cast, watched: every run fused).
    nbytes1: dict = dataclasses.field(default_factory=dict)
    nbytes2: dict = dataclasses.field(default_factory=dict)
    meter1: dict = dataclasses.field(default_factory=dict)
    meter2: dict = dataclasses.field(default_factory=dict)
    direct: bool = False
    # Per run (in order): both send buffers' shapes; the exchange order's index on the device.
    shape1: tuple = ()
    shape2: tuple = ()
    order: torch.Tensor | None = None
    # {divisor: ((hop 1's encoding, hop 2's requantization, the decoding) per run)}: the launches
    # of the first call with that divisor, where each step was one launch (kernels.Launch).
    launches: dict = dataclasses.field(default_factory=dict)
    seeds: Any = None  # both hops' slice prefixes of each call (rng.CallSeeds)
    keys: Any = None  # the same as the launches take them (wire.launch_keys; where direct)
    meter12: tuple = ()  # both hops' meter entries where there is one run

    @classmethod
    def build(cls, comm: "QuantizedReduceScatter", x: torch.Tensor, output: torch.Tensor) -> "TwoHopPlan":
        topo = comm.topology
        host_moves_bytes = not all(pipelines_exchanges(x.device.type, dist.get_backend(grp))
                                   for grp in (topo.intra_group, topo.inter_group))
        plan = cls.of(comm.config.grads, x, topo.nodes, comm.layouts.get, host_moves_bytes)
        m, d = topo.ranks_per_node, topo.nodes
        for run in plan.runs:
            plan.nbytes1[run], plan.nbytes2[run] = run.nbytes(plan.hop1), run.nbytes(plan.hop2)
            plan.meter1[run] = peer_entries("grads", d * plan.nbytes1[run], d * plan.real[run], m - 1, 0)
            plan.meter2[run] = peer_entries("grads", plan.nbytes2[run], plan.real[run], 0, d - 1)
        probe = torch.empty(0, dtype=torch.uint8, device=x.device)
        direct = (plan.layout.identity and output.is_contiguous()
                  and output.dtype in (torch.float32, torch.bfloat16, torch.float16)
                  and all(plan.hop2.fuses_slices(run, probe) for run in plan.runs))
        seeds = comm.call_seeds((topo.rank, 4), (topo.rank, 5))
        return dataclasses.replace(
            plan, direct=direct, shape1=tuple((x.shape[0], plan.nbytes1[run]) for run in plan.runs),
            shape2=tuple((d, plan.nbytes2[run]) for run in plan.runs), order=topo.exchange_index(x.device),
            seeds=seeds, keys=launch_keys(seeds, None, None) if direct else None,
            meter12=plan.meter1[plan.runs[0]] + plan.meter2[plan.runs[0]] if len(plan.runs) == 1 else ())

    @classmethod
    def of(cls, g: GradComm, x: torch.Tensor, nodes: int, layout_of: Callable[..., RowLayout],
           host_moves_bytes: bool) -> "TwoHopPlan":
        """The plan of ``x`` (``[world, s]``) over ``nodes`` nodes; ``layout_of(s, unit, device)``
        gives the row layout; ``host_moves_bytes``: :func:`pipelines_exchanges` is false for a hop."""
        world, s = x.shape
        hop1 = grad_codec(g, g.bits_intra, x.dtype)
        hop2 = grad_codec(g, g.bits_inter, torch.float32)
        layout = layout_of(s, math.lcm(hop1.unit, hop2.unit), x.device)
        lp = hop1.padded_len(layout.wire_length)
        bounds = pipeline_slices_bounds(lp, hop1, g.rounding_slices, g.pipeline_min_slice)
        groups = exchange_groups(slice_bytes(hop1, hop2, bounds, world, nodes), exchange_min_bytes(g, host_moves_bytes))
        per = bounds[0][1] - bounds[0][0]
        runs = tuple(SliceRun(r.start, len(r), per, lp) for r in groups)
        real = {run: sum(layout.real_elements(a, b) for a, b in run.bounds()) for run in runs}
        return cls(hop1, hop2, layout, lp, runs, real)


def destination_major(x: torch.Tensor, order: torch.Tensor, a: int, b: int,
                      layout: RowLayout | None = None) -> torch.Tensor:
    """Columns ``[a, b)`` of the gradient ``x`` (``[world, s]``, group-rank order; columns of
    ``layout``'s rows where given) padded to ``b - a`` by repeating its last column, as fp32
    ``[world, b - a]`` in destination-major order for the intra-node exchange: row ``k`` holds the
    chunk of group rank ``order[k]`` (:meth:`Topology.exchange_index`: local index major, then the
    inter-node group's order), so local peer ``l`` receives the D rows its inter-node group owns
    contiguously. One slice at a time: no copy of the whole gradient is made."""
    if layout is None:
        layout = RowLayout.of(None, x.shape[1], 1)
    return _pad_cols(layout.columns(x, order, a, b).float(), b - a)


def real_elements(a: int, b: int, s: int) -> int:
    """Elements of the padded slice ``[a, b)`` that are real data (not padding)."""
    return max(0, min(b, s) - a)


def pipeline_slices_bounds(length: int, codec: RowCodec, n: int, min_slice: int = 1) -> list[tuple[int, int]]:
    """Up to ``n`` contiguous slices of ``[0, length)``, each a whole number of codec units and,
    unless the whole row is shorter, at least ``min_slice`` elements: below that, a slice's
    collective costs more in latency than its overlap saves."""
    unit = 1 if codec.exact else math.lcm(codec.group_size, codec.hadamard_block or 1)
    units = max(1, length // unit)
    n = max(1, min(n, units, length // max(1, min_slice)))
    per = -(-units // n) * unit
    return [(a, min(a + per, length)) for a in range(0, length, per)]


def pipelines_exchanges(device_type: str, backend: str) -> bool:
    """Whether ``pipeline_slices="auto"`` sends each rounding slice in exchanges of its own (so
    that encoding one overlaps the transfer of the previous), for tensors on ``device_type``
    and a group of ``backend`` (``dist.get_backend``; ``"cpu:gloo,cuda:nccl"`` picks the
    device's). Not where the host moves the bytes: CPU tensors, or a gloo group (CUDA tensors
    are staged through the host). There no engine is free to overlap with, and each extra
    collective costs its latency: all slices travel in one exchange per hop."""
    return device_type != "cpu" and backend_of(backend, device_type) != "gloo"


def exchange_min_bytes(g: GradComm, host_moves_bytes: bool) -> float:
    """The bytes each exchange of a two-level reduce-scatter moves at least (:func:`exchange_groups`):
    0 for a slice count (every slice its own exchange); for ``"auto"``, ``pipeline_min_bytes``
    where an engine overlaps the transfers and infinity (one exchange per hop) where the host moves
    the bytes (:func:`pipelines_exchanges`; the performance model's ``Hardware.host_staged``)."""
    if g.pipeline_slices != "auto":
        return 0
    return math.inf if host_moves_bytes else g.pipeline_min_bytes


def slice_bytes(hop1: RowCodec, hop2: RowCodec, bounds: list[tuple[int, int]], world: int, nodes: int) -> list[int]:
    """The bytes each rounding slice of ``bounds`` adds to the send buffer of the hop where it is
    smaller: hop 1 sends ``world`` rows (one per rank), hop 2 ``nodes`` rows."""
    return [min(world * hop1.row_nbytes(b - a), nodes * hop2.row_nbytes(b - a)) for a, b in bounds]


def exchange_groups(sizes: list[int], min_bytes: float) -> list[range]:
    """The rounding slices each exchange carries, in order: consecutive slices until their bytes
    (``sizes``: :func:`slice_bytes`) reach ``min_bytes``; a last group short of it joins the one
    before. ``0``: one slice each; infinity: all of them in one."""
    groups: list[range] = []
    start, total = 0, 0
    for k, nbytes in enumerate(sizes):
        total += nbytes
        if total >= min_bytes:
            groups.append(range(start, k + 1))
            start, total = k + 1, 0
    if start < len(sizes):
        groups[-1:] = [range(groups[-1].start if groups else start, len(sizes))]
    return groups
