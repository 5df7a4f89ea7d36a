"""SDP4Bit's qWD: the all-gather of quantized weight *differences*, with full or node replicas.

FSDP2's gathered buffer is ``[world, n]``: row ``r`` is rank ``r``'s shard. A replica holds rows
of it as they were last gathered (parameter dtype). A gather sends ``quantize(shard -
replica[own row])``; every holder of a row adds the same dequantized difference to it, so the
copies of a row stay bit-identical and the quantization error does not accumulate (the next
difference is taken against the replica, which already contains it).

* ``full`` replica: every rank holds all ``world`` rows; one all-gather of the differences.
* ``node`` replica (D nodes x M ranks): rank (d, j) holds the D rows ``(d', j)`` of the ranks
  with its local index on every node (by the nodes the ranks are really on): full/M of the
  group. The differences travel among the D ranks with local rank ``j`` (between nodes, in
  ``bits``); then the node's ranks all-gather their updated rows exactly, in the parameter dtype,
  to fill the output. Each row gets the same arithmetic as in the full design, so the weights
  (and the losses) are bit-identical to it for the same seed.
* ``exact`` (``node`` on one node): the node gathers the group in the parameter dtype.

The first gather (and one after :meth:`reset` or any change other than an optimizer's step: a
hand-written or functional update, an EMA swap, a load, an edit, whose size nothing bounds) sends
exact values; an optimizer's step travels as a quantized difference; a gather with no change
since the last one (the backward gather of a step) sends no difference (the node replica still
fills the output inside the node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import QuantConfig
from .base import NUMBER_DTYPES, WeightAllGather
from .collectives import all_gather, all_gather_coalesced, all_gather_flat, gathers_grouped
from .gather_plan import GatherPlan
from .meter import peer_entries
from .topology import Topology
from .versions import ChangeTracker
from .weight_codec import weight_codec
from .wire import recording


def replica_layout(choice: str, nodes: int, ranks_per_node: int) -> str:
    """``full``, ``node`` or ``exact``: where replicas of the ``weights.replica`` ``choice``
    live with ``nodes`` x ``ranks_per_node`` ranks."""
    # ``auto`` is ``node``: on one node nothing crosses a node, so nothing needs a replica.
    d, m = nodes, ranks_per_node
    if choice == "full" or m == 1:
        return "full"
    return "node" if d > 1 else "exact"


class DifferenceAllGather(WeightAllGather):
    """The weight-difference all-gather of one FSDP group (see the module doc)."""

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int,
                 tracker: ChangeTracker | None = None) -> None:
        super().__init__(config, topology, comm_id, tracker)
        self.codec = weight_codec(config.weights)
        self.layout = replica_layout(config.weights.replica, topology.nodes, topology.ranks_per_node)
        self.version = 0
        self.gathers = 0
        self.exact_resends = 0
        self.replica: torch.Tensor | None = None  # [len(rows), n], the parameter dtype
        # FSDP2's all-gather row (elements, dtype, device), known before the first gather, so that a
        # checkpoint can be loaded into replica rows of the right shape (:meth:`replica_state`).
        self.row: tuple[int, torch.dtype | None, torch.device] | None = None
        self._peers = topology.peers()  # the change agreement's peers (intra, inter), for the meter
        self._views: tuple | None = None  # _replica_rows

    @property
    def rows(self) -> list[int]:
        """The rows of the gathered ``[world, n]`` buffer this rank's replica holds, in order."""
        t = self.topology
        if self.layout == "node":
            return list(t.inter_ranks[t.local_rank])
        return [] if self.layout == "exact" else list(range(t.world_size))

    def _holders(self, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, tuple[int, int]]:
        """The group holding this rank's rows, and its peers (intra, inter) for the meter."""
        if self.layout == "node":
            return self.topology.inter_group, (0, self.topology.nodes - 1)
        return group, self.topology.peers()

    def reset(self) -> None:
        """Forget the replica: the next gather re-establishes it with exact values."""
        self.replica = None
        self._views = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        if self.handled_elsewhere(output_tensor, input_tensor, group, async_op):
            return None
        n = input_tensor.numel()
        if self.layout == "exact" or not self.config.quantizes_shard(n):
            self.plain(output_tensor, input_tensor, group)
            return None
        self.gathers += 1
        # Everything fixed by the shard's size, dtype and device, the groups and the config is
        # planned at the first call.
        key = (n, input_tensor.dtype, input_tensor.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(n, input_tensor.device)
        changed, stale = self.tracker.take(self.index, group, input_tensor.device,
                                           self._peers, self.byte_meter)
        r = self.replica
        fresh = r is None or r.shape != plan.replica_shape or r.dtype != output_tensor.dtype
        if fresh or stale:
            self.exact_resends += int(not fresh)
            # Exact values are the new reference: changes made before them (a materialization,
            # a load) are sent now, not again after the next step. Every rank is here together.
            self.tracker.watches[self.index].rebase()
            self.plain(output_tensor, input_tensor, group)
            self.replica = output_tensor.detach().view(-1, n)[self.rows]  # indexing copies
            return None
        if changed:
            self._update(input_tensor, group, plan)
        self._fill(output_tensor, plan)
        return None

    def _plan(self, n: int, device: torch.device) -> "DifferencePlan":
        t = self.topology
        rows = self.rows
        holders = (0, t.nodes - 1) if self.layout == "node" else self._peers  # the meter's peers
        own = t.inter_position if self.layout == "node" else t.rank
        gather = GatherPlan.build(self, self.codec, n, device, holders, len(rows), (t.rank, 2))
        source = None
        if self.layout == "node" and not (t.node_major and gathers_grouped(t.intra_group, device.type)):
            order = t.exchange_order()
            source = torch.tensor(sorted(range(len(order)), key=order.__getitem__), dtype=torch.int64, device=device)
        return DifferencePlan(gather, torch.Size((len(rows), n)), own, source, (t.ranks_per_node * n,) * t.nodes)

    def _replica_rows(self, plan: "DifferencePlan") -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(the replica row this rank's shard is the value of, ``[1, n]``; the replica flat; its
        rows), views made once for each replica."""
        r = self.replica
        views = self._views
        if views is None or views[0] is not r:
            views = self._views = (r, r[plan.own].view(1, -1), r.view(-1), list(r.unbind(0)))
        return views[1:]

    def _update(self, shard: torch.Tensor, group: dist.ProcessGroup, plan: "DifferencePlan") -> None:
        """Send this rank's quantized difference (``shard``: FSDP2's, ``[n]``); add every
        holder's to the replica rows."""
        self.version += 1
        g = plan.gather
        base = self._replica_rows(plan)[0]
        holders = self.topology.inter_group if self.layout == "node" else group
        if g.again(shard, self.replica):
            # the first call's launches again: quantize(shard - base), replica += the differences
            g.decode_again(g.gather(self, g.encode_again(shard, g.keys(self.version)[0], base=base), holders),
                           self.replica)
        else:
            seed = g.seeds(self.version)[0]
            learn = g.fused and not g.launches
            # quantize(shard - replica[own row]) in one pass on CUDA
            with recording(learn) as encoded:
                send = g.encode(self.codec, shard.detach().view(1, -1), seed, base=base)
            gathered = g.gather(self, send, holders)
            # replica += dequantize(every holder's difference), in the replica's dtype
            with recording(learn) as decoded:
                self.codec.decode_into(gathered, g.layout.wire_length, self.replica, add=True,
                                       columns=g.layout.position)
            if learn:
                g.keep(encoded, decoded)
        every = self.config.verify_replicas_every
        if every and self.version % every == 0:
            self._verify(group)

    def _fill(self, output: torch.Tensor, plan: "DifferencePlan") -> None:
        """The output from the replica; node replicas: every local rank's rows, exactly."""
        if self.layout == "full":
            output.copy_(self._replica_rows(plan)[1])
            return
        t = self.topology
        replica = self.replica
        if plan.source is None:
            # Node d's ranks are the output's rows d * M .. d * M + M - 1 (node_major): each
            # replica row d gathered across the node straight into that block, every row in one
            # grouped collective (gathers_grouped: one NCCL group; no temporary, no second pass).
            flat = output if output.dim() == 1 else output.view(-1)
            # (split_with_sizes: Tensor.split's Python wrapper costs more than the views it makes)
            all_gather_coalesced(flat.split_with_sizes(plan.blocks), self._replica_rows(plan)[2], t.intra_group)
        else:
            # One temporary of the group's size: rows arrive in the exchange order (local index
            # major); row k of the output is row source[k] of it (a gather: index_copy_'s scatter
            # costs several times more on a CPU, the same one launch on a GPU).
            buf = torch.empty(t.world_size, plan.replica_shape[1], dtype=replica.dtype, device=replica.device)
            all_gather(buf, replica, t.intra_group)
            torch.index_select(buf, 0, plan.source, out=output.view(buf.shape))
        entries = plan.fill_meter.get(replica.dtype)
        if entries is None:
            entries = plan.fill_meter[replica.dtype] = peer_entries(
                "weights", replica.numel() * replica.element_size(), replica.numel(), t.ranks_per_node - 1, 0)
        self.byte_meter.add(entries)

    def _checksum(self, chunk: int = 1 << 20) -> torch.Tensor:
        """An exact integer checksum of the replica's bits (position-weighted and plain sums),
        in cache-sized chunks so that no int64 temporary is the replica's size."""
        bits = self.replica.view(torch.int16 if self.replica.element_size() == 2 else torch.int32).view(-1)
        total = torch.zeros(2, dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64, device=bits.device) % 65521
            total[0] += (part * weights).sum()
            total[1] += part.sum()
        return total

    def _verify(self, group: dist.ProcessGroup) -> None:
        """Compare the replica's checksum among the ranks holding its rows, then tell every rank
        of ``group`` (one flag all-reduce) so that all of them raise, none waits in the next
        collective. Opt-in (``verify_replicas_every``), so its host sync is accepted."""
        mine = self._checksum()
        holders, peers = self._holders(group)
        ranks = dist.get_process_group_ranks(holders)
        everyone = torch.empty(len(ranks) * 2, dtype=torch.int64, device=mine.device)
        all_gather_flat(everyone, mine, holders)
        self.meter("control", mine.numel() * 8, 0, peers)
        rows = everyone.view(-1, 2)
        differs = (rows != rows[0]).any(dim=1)
        flag = differs.any().to(torch.int32).view(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.meter("control", flag.element_size(), 0)
        if flag.item():
            bad = [ranks[i] for i, d in enumerate(differs.tolist()) if d]
            where = f"ranks {bad} differ from rank {ranks[0]}" if bad else "in another replica group"
            raise RuntimeError(
                f"weight-difference replicas diverged: {self.name} at gather {self.gathers}: {where}"
            )

    def state_dict(self) -> dict[str, Any]:
        """Counters only; the replica rows are saved by :meth:`replica_rows` (through DCP)."""
        return {"version": self.version, "changed": self.tracker.pending_change(self.index)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Loading restores parameters and replicas together: the parameters' counters are the
        # reference from here on, and a change saved before its gather is still to be sent.
        self.version = int(state.get("version", 0))
        self.tracker.watches[self.index].rebase(changed=bool(state.get("changed", False)))
        self.tracker.request()

    def holds_replicas(self) -> bool:
        return not self.exact

    def replica_rows(self) -> dict[int, torch.Tensor]:
        """``{row of the gathered buffer: its replica values}`` held by this rank (empty before
        the first gather)."""
        if self.replica is None:
            return {}
        return {row: self.replica[k] for k, row in enumerate(self.rows)}

    def expect_row(self, elements: int, dtype: torch.dtype | None, device: torch.device) -> None:
        """FSDP2's all-gather row of this group: ``elements`` of ``dtype`` on ``device``."""
        self.row = (elements, dtype, device)

    def replica_state(self) -> tuple[dict[int, torch.Tensor], bool]:
        """``({row: values}, held)``: the replica rows this rank holds (``held``), or, before the
        first gather, zero rows of the shape a gather will make (``held`` false), which a
        checkpoint loads into; ``({}, False)`` where the group keeps no replica."""
        if self.replica is not None:
            return self.replica_rows(), True
        if self.row is None:
            return {}, False
        n, dtype, device = self.row
        if dtype not in NUMBER_DTYPES or self.layout == "exact" or not self.config.quantizes_shard(n):
            return {}, False
        return {row: torch.zeros(n, dtype=dtype, device=device) for row in self.rows}, False

    def load_replica_rows(self, rows: dict[int, torch.Tensor] | None) -> None:
        """Restore the replica from ``{row: values}`` holding every row of :attr:`rows`;
        ``None``: re-establish it with exact values at the next gather."""
        self.replica = None if rows is None else torch.stack([rows[r] for r in self.rows])
        self._views = None


@dataclass(frozen=True)
class DifferencePlan:
    """What a difference gather of one shard shape does, fixed at its first call: the gather of
    the encoded differences among the holders of this rank's rows, the replica's shape and the
    replica row this rank's shard is the value of (``own``)."""

    gather: GatherPlan
    replica_shape: torch.Size
    own: int
    # Node replicas gathered through one temporary (the group is not node-major, or the
    # backend is gloo: gathers_grouped): the row of the intra-node gather (exchange order) each
    # output row is.
    source: torch.Tensor | None = None
    blocks: tuple = ()  # node replicas: the elements of each node's rows of the output (M * n each)
    fill_meter: dict = field(default_factory=dict)  # node replicas: the fill's meter entries by dtype
