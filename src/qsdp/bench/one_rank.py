"""One rank's part of the collectives, played in one process: its codec work, not its wire.

In each collective a rank of a ``D x M`` world runs the codec calls of :mod:`qsdp.comm` on its
own data: it encodes its shard or its gradient and decodes what its peers sent. Here one process
plays rank ``rank`` alone. :class:`RankGather` and :class:`RankReduceScatter` make that rank's
calls with the codecs, seeds, rounding slices and row order of the comm objects
(:class:`~qsdp.comm.all_gather.QuantizedAllGather`,
:class:`~qsdp.comm.difference.DifferenceAllGather`,
:class:`~qsdp.comm.reduce_scatter.QuantizedReduceScatter`), and stand the peers' rows in with
copies of this rank's own: decoding costs the same whatever the bytes are.

Every piece of qsdp's own work (the codec calls and the layout and bookkeeping copies around
them) runs inside a ``torch.profiler`` range ``qsdp.codec.<step>``, the step named after the
workload of ``qsdp bench kernels`` it runs where one matches (``quantize``, ``hadamard_quantize``,
``dequantize_requantize``, ``dequantize_accumulate``, ``weight_difference_quantize``,
``replica_update``; also ``dequantize``, a direct gather's decode, and ``replica_fill``); the
copies that stand in for the wire run outside them. A profile of a step therefore tells qsdp's
kernels from the rest (:mod:`qsdp.bench.codec_share`).

With nearest rounding and every rank holding the same data the peers' rows really are this
rank's, so the results equal what :mod:`qsdp.check.emulate` gives that rank (tests check this).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..codecs.rng import derive_seed
from ..comm.difference import replica_layout
from ..comm.reduce_scatter import TwoHopPlan, grad_codec, pipelines_exchanges
from ..comm.row_layout import RowLayout
from ..comm.topology import Topology
from ..comm.weight_codec import weight_codec
from ..comm.wire import sum_rows
from ..config import QuantConfig

__all__ = ["CODEC_RANGE", "RankGather", "RankReduceScatter", "gather_kind"]

CODEC_RANGE = "qsdp.codec"


def _codec(step: str) -> record_function:
    """The profiler range of one piece of qsdp's work."""
    return record_function(f"{CODEC_RANGE}.{step}")


def _encode_step(codec) -> str:
    return "hadamard_quantize" if codec.hadamard_block and not codec.exact else "quantize"


def _peers(rows: torch.Tensor, count: int) -> torch.Tensor:
    """What a collective delivers when all ``count`` senders sent ``rows``: their copies one
    after another, in a new buffer (the wire's stand-in)."""
    return rows.repeat(count, 1)


def gather_kind(cfg: QuantConfig, nodes: int, ranks_per_node: int, numel: int) -> str:
    """How a group's weight all-gather travels: ``plain`` (unquantized, also a node replica's
    ``exact`` layout on one node), ``direct``, or the weight-difference replicas ``full`` or
    ``node``."""
    w = cfg.weights
    if w.mode == "plain" or not cfg.quantizes_shard(numel):
        return "plain"
    if w.mode == "direct":
        return "direct"
    layout = replica_layout(w.replica, nodes, ranks_per_node)
    return "plain" if layout == "exact" else layout


class RankGather:
    """One FSDP group's weight all-gather as rank ``rank`` of ``nodes x ranks_per_node`` runs it.

    ``shard``: the rank's first shard (``[n]``, the parameter dtype); a weight-difference replica
    starts from it as the exact first gather would leave it (every row this rank's, see the
    module doc). Each call fills ``output`` (``[world * n]``, the parameter dtype).
    """

    def __init__(self, cfg: QuantConfig, nodes: int, ranks_per_node: int, rank: int, comm_id: int,
                 shard: torch.Tensor) -> None:
        self.cfg, self.d, self.m, self.rank, self.comm_id = cfg, nodes, ranks_per_node, rank, comm_id
        self.world = nodes * ranks_per_node
        self.node, self.local = divmod(rank, ranks_per_node)
        self.n = shard.numel()
        self.kind = gather_kind(cfg, nodes, ranks_per_node, self.n)
        self.codec = weight_codec(cfg.weights)
        self.version = 0
        holders = {"full": self.world, "node": nodes}.get(self.kind, 0)
        self.replica = _peers(shard.detach().view(1, self.n), holders) if holders else None

    def __call__(self, shard: torch.Tensor, output: torch.Tensor, changed: bool) -> None:
        """One gather; ``changed``: the shard changed since the last one (an optimizer step)."""
        n, world = self.n, self.world
        rows = output.view(world, n)
        mine = shard.detach().view(1, n)
        if self.kind == "plain":
            rows.copy_(_peers(mine, world))
            return
        if self.kind == "direct":
            self.version += int(changed)
            with _codec("quantize"):
                send = self.codec.encode(mine, seed=derive_seed(self.cfg.seed, self.comm_id, self.version, self.rank, 1))
            recv = _peers(send, world)
            with _codec("dequantize"):
                self.codec.decode_into(recv, n, rows)
            return
        if changed:
            self._update(mine)
        self._fill(rows)

    def _update(self, mine: torch.Tensor) -> None:
        self.version += 1
        own = self.node if self.kind == "node" else self.rank
        seed = derive_seed(self.cfg.seed, self.comm_id, self.version, self.rank, 2)
        with _codec("weight_difference_quantize"):
            send = self.codec.encode_difference(mine, self.replica[own].view(1, self.n), seed=seed)
        recv = _peers(send, self.replica.shape[0])
        with _codec("replica_update"):
            self.codec.decode_into(recv, self.n, self.replica, add=True)

    def _fill(self, rows: torch.Tensor) -> None:
        if self.kind == "full":
            with _codec("replica_fill"):
                rows.copy_(self.replica)
            return
        # node replicas: the node's ranks gather their rows exactly, local-rank-major
        received = _peers(self.replica.reshape(1, -1), self.m).view(self.m, self.d, self.n)
        with _codec("replica_fill"):
            rows.view(self.d, self.m, self.n).copy_(received.transpose(0, 1))


class RankReduceScatter:
    """One FSDP group's gradient reduce-scatter (``op=AVG``) as rank ``rank`` runs it."""

    def __init__(self, cfg: QuantConfig, nodes: int, ranks_per_node: int, rank: int, comm_id: int) -> None:
        self.cfg, self.d, self.m, self.rank, self.comm_id = cfg, nodes, ranks_per_node, rank, comm_id
        self.world = nodes * ranks_per_node
        self.node, self.local = divmod(rank, ranks_per_node)
        self.calls = 0
        # Built once, as the comm objects hold theirs: its exchange index is made on the device
        # at the first call and reused (a new one per call would add a host-to-device copy,
        # blocking on a GPU, that the real path does not make).
        self.topology = Topology.contiguous(nodes, ranks_per_node, rank)
        self._plans: dict[tuple, TwoHopPlan] = {}

    def _seed(self, *parts: int) -> int:
        return derive_seed(self.cfg.seed, self.comm_id, self.calls, self.rank, *parts)

    def __call__(self, grads: torch.Tensor) -> torch.Tensor:
        """``grads``: this rank's ``input_tensor`` as ``[world, s]``; returns its ``[s]`` fp32
        output, the average of every rank's row ``rank`` (all of them this rank's here)."""
        world, s = grads.shape
        g, d, m = self.cfg.grads, self.d, self.m
        if g.mode == "plain" or not self.cfg.quantizes_shard(s):
            return sum_rows(_peers(grads[self.rank:self.rank + 1].float(), world)) / world
        self.calls += 1
        if g.mode == "one_level" or d == 1 or m == 1:
            bits = g.bits if g.mode == "one_level" else (g.bits_intra if d == 1 else g.bits_inter)
            codec = grad_codec(g, bits, grads.dtype)
            with _codec(_encode_step(codec)):
                send = codec.encode(grads, seed=self._seed(3))
            recv = _peers(send[self.rank:self.rank + 1], world)
            with _codec("dequantize_accumulate"):
                return codec.decode_sum(recv, s, finish=True) / world
        return self._two_hops(grads)

    def _two_hops(self, grads: torch.Tensor) -> torch.Tensor:
        """The exchanges of :meth:`QuantizedReduceScatter._two_hops` with their codec calls: the
        rounding slices of an exchange encoded, requantized and decoded by one call each."""
        d, m = self.d, self.m
        s = grads.shape[1]
        plan = self._plan(grads)
        hop1, hop2 = plan.hop1, plan.hop2
        out = torch.empty(plan.lp, dtype=torch.float32, device=grads.device)
        order = self.topology.exchange_index(grads.device)
        prefix1, prefix2 = self._seed(4), self._seed(5)
        for run in plan.runs:
            with _codec(_encode_step(hop1)):
                send = torch.empty(grads.shape[0], run.nbytes(hop1), dtype=torch.uint8, device=grads.device)
                hop1.encode_slices(grads, run, prefix=prefix1, out=send, order=order)
            # hop 1 inside the node: every local peer's D rows for this local rank
            recv = _peers(send[self.local * d:(self.local + 1) * d], m)
            with _codec("dequantize_requantize"):
                send2 = torch.empty(d, run.nbytes(hop2), dtype=torch.uint8, device=grads.device)
                hop1.decode_sum_encode_slices(recv, run, sources=m, codec=hop2, prefix=prefix2, out=send2)
            # hop 2 between nodes: every node's partial sum of this node's row
            recv2 = _peers(send2[self.node:self.node + 1], d)
            with _codec("dequantize_accumulate"):
                hop2.decode_sum_slices(recv2, run, out)
        with _codec("dequantize_accumulate"):
            return out[:s] / grads.shape[0]

    def _plan(self, grads: torch.Tensor) -> TwoHopPlan:
        """The comm's plan for this shape, built once: its exchanges as NCCL would group them on
        a GPU (one per hop where the host moves the bytes: CPU tensors)."""
        key = (tuple(grads.shape), grads.dtype, str(grads.device))
        if key not in self._plans:
            host_moves_bytes = not pipelines_exchanges(grads.device.type, "nccl")
            self._plans[key] = TwoHopPlan.of(self.cfg.grads, grads, self.d, self._layout, host_moves_bytes)
        return self._plans[key]

    @staticmethod
    def _layout(length: int, unit: int, device: torch.device) -> RowLayout:
        return RowLayout.of(None, length, unit, device)
