"""Weight all-gathers with FSDP2's custom comm interface.

FSDP2 calls ``allocate(size, dtype=, device=)`` for the flat unsharded buffer, copies this
rank's shard into its slice (``input_tensor`` is that view of ``output_tensor``), then calls
``comm(output_tensor, input_tensor, group, async_op)`` and copies the parameters out of
``output_tensor``. Each class here fills ``output_tensor`` on every rank and returns ``None``
(the work is done when the call returns).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..codecs.rng import derive_seed
from ..config import QuantConfig, WeightComm
from .collectives import all_gather_flat
from .meter import METER
from .topology import Topology
from .versions import versions
from .wire import RowCodec


class _Base:
    """Allocation and bookkeeping shared by the weight all-gathers."""

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int) -> None:
        self.config = config
        self.topology = topology
        self.comm_id = comm_id

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup) -> None:
        if group.size() != self.topology.world_size:
            raise RuntimeError(
                f"FSDP all-gather group has {group.size()} ranks but qsdp was set up for "
                f"{self.topology.world_size}; pass the FSDP mesh's group to quantize_comms(group=...)"
            )

    def _plain(self, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
        all_gather_flat(output, shard, group)
        intra, inter = self.topology.peers()
        METER.record_peers("weights", shard.numel() * shard.element_size(), shard.numel(), intra, inter)

    def _gather_bytes(self, send: torch.Tensor, elements: int, group: dist.ProcessGroup) -> torch.Tensor:
        """All-gather this rank's encoded row ``[1, B]`` into ``[world, B]``, metered as
        ``elements`` weights."""
        gathered = torch.empty(self.topology.world_size, send.shape[1], dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        intra, inter = self.topology.peers()
        METER.record_peers("weights", send.numel(), elements, intra, inter)
        return gathered

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        pass


class PlainAllGather(_Base):
    """The ``fsdp`` preset: the same all-gather FSDP2 does by default, metered."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._check_group(group)
        self._plain(output_tensor, input_tensor, group)
        return None


def weight_codec(w: WeightComm) -> RowCodec:
    return RowCodec(bits=w.bits, group_size=w.group_size, symmetric=w.symmetric, rounding=w.rounding)


class QuantizedAllGather(_Base):
    """Direct weight quantization (QSDP, ZeRO++ qwZ, SDP4Bit's qW ablation).

    Each rank quantizes its shard, the packed bytes are all-gathered, every rank dequantizes all
    shards into the output (in the parameter dtype). The rounding seed depends on the shard's
    *version* (bumped whenever its content changes), so the forward and backward gathers of one
    step, which see the same shard, produce bit-identical weights.
    """

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int) -> None:
        super().__init__(config, topology, comm_id)
        self.codec = weight_codec(config.weights)
        self.version = 0
        self._last: torch.Tensor | None = None

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._check_group(group)
        n = input_tensor.numel()
        if n < max(1, self.config.min_shard_numel):
            self._plain(output_tensor, input_tensor, group)
            return None
        if self._last is None or self._last.shape != input_tensor.shape or not torch.equal(self._last, input_tensor):
            self.version += 1
            self._last = input_tensor.detach().clone()
        world, rank = self.topology.world_size, self.topology.rank
        seed = derive_seed(self.config.seed, self.comm_id, self.version, rank, 1)
        send = self.codec.encode(input_tensor.detach().view(1, n), seed=seed)
        gathered = self._gather_bytes(send, n, group)
        self.codec.decode_into(gathered, n, output_tensor.view(world, n))
        return None

    def state_dict(self) -> dict[str, Any]:
        # The last shard decides whether the next gather is a new version: without it a resumed
        # run would bump the version (and change the rounding) where the original did not.
        return {"version": self.version, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        last = state.get("last")
        self._last = None if last is None else last.detach().clone()


class DifferenceAllGather(_Base):
    """SDP4Bit's qWD: all-gather of quantized weight *differences*.

    Every rank holds ``replica``, the unsharded flat buffer as it was last gathered (parameter
    dtype). A gather sends ``quantize(shard - replica[own slice])``; every rank, the sender
    included, adds the same dequantized differences to its replica, so replicas stay
    bit-identical and the quantization error does not accumulate (the next difference is taken
    against the replica, which already contains it). The replica is then copied to the output.

    * The first gather (and the first after :meth:`reset`) sends exact values.
    * A gather where no rank's shard changed since the last one (the backward gather of a step
      under ``reshard_after_forward=True``) sends nothing but a one-integer agreement.
    """

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int) -> None:
        super().__init__(config, topology, comm_id)
        self.codec = weight_codec(config.weights)
        self.version = 0
        self.gathers = 0
        self.replica: torch.Tensor | None = None
        self._last: torch.Tensor | None = None
        # The FSDP group's sharded parameters and their version counters after the last
        # optimizer step (or gather): see qsdp.comm.versions.
        self.params: list[torch.Tensor] = []
        self.name = f"group {comm_id}"
        self._expected_versions: tuple[int, ...] | None = None
        self.exact_resends = 0

    def track(self, params: list[torch.Tensor], name: str) -> None:
        """Watch ``params`` (the group's sharded parameters) for changes outside the optimizer."""
        self.params = list(params)
        self.name = name
        self._expected_versions = None

    def note_optimizer_step(self) -> None:
        """Called after every optimizer step: the changes made so far are the optimizer's."""
        if self.params:
            self._expected_versions = versions(self.params)

    def _changed_outside_optimizer(self) -> bool:
        return bool(self.params) and self._expected_versions is not None and versions(self.params) != self._expected_versions

    def reset(self) -> None:
        """Forget the replica: the next gather re-establishes it with exact values."""
        self.replica = None
        self._last = None

    def _agree(self, changed: bool, stale: bool, device: torch.device, group) -> tuple[bool, bool]:
        """One tiny all-reduce: did any rank's shard change, and did any change outside the
        optimizer (so every rank takes the same path)."""
        flags = torch.tensor([int(changed), int(stale)], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        intra, inter = self.topology.peers()
        METER.record_peers("control", flags.numel() * flags.element_size(), 0, intra, inter)
        return bool(flags[0].item()), bool(flags[1].item())

    def _verify(self, group) -> None:
        """Compare an exact integer checksum of the replica across ranks."""
        bits = self.replica.view(torch.int16 if self.replica.element_size() == 2 else torch.int32)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) % 65521
        mine = torch.stack([(bits.to(torch.int64) * weights).sum(), bits.to(torch.int64).sum()])
        everyone = torch.empty(self.topology.world_size * 2, dtype=torch.int64, device=mine.device)
        all_gather_flat(everyone, mine, group)
        everyone = everyone.view(-1, 2)
        intra, inter = self.topology.peers()
        METER.record_peers("control", mine.numel() * 8, 0, intra, inter)
        if not bool((everyone == everyone[0]).all()):
            bad = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
            raise RuntimeError(
                f"weight-difference replicas diverged: {self.name} at gather {self.gathers}: "
                f"ranks {bad} differ from rank 0"
            )

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._check_group(group)
        n = input_tensor.numel()
        world, rank = self.topology.world_size, self.topology.rank
        if n < max(1, self.config.min_shard_numel):
            self._plain(output_tensor, input_tensor, group)
            return None
        shard = input_tensor.detach()
        self.gathers += 1
        fresh = self.replica is None or self.replica.numel() != output_tensor.numel() or self.replica.dtype != output_tensor.dtype
        changed = stale = False
        if not fresh:
            changed, stale = self._agree(not torch.equal(self._last, shard), self._changed_outside_optimizer(), shard.device, group)
            if stale:
                self.exact_resends += 1
        if fresh or stale:
            self._plain(output_tensor, shard, group)
            self.replica = output_tensor.detach().clone()
            self._last = shard.clone()
            self.note_optimizer_step()
            return None
        self.note_optimizer_step()
        if not changed:
            output_tensor.copy_(self.replica)
            return None
        self.version += 1
        replica_rows = self.replica.view(world, n)
        seed = derive_seed(self.config.seed, self.comm_id, self.version, rank, 2)
        # quantize(shard - replica[own slice]) in one pass on CUDA
        send = self.codec.encode_difference(shard.view(1, n), replica_rows[rank].view(1, n), seed=seed)
        gathered = self._gather_bytes(send, n, group)
        # ``shard`` is a view of ``output_tensor``: remember it before the output is overwritten.
        self._last.copy_(shard)
        # replica += dequantize(every rank's difference), in the replica's dtype, one pass on CUDA
        self.codec.decode_into(gathered, n, replica_rows, add=True)
        output_tensor.copy_(self.replica)
        every = self.config.verify_replicas_every
        if every and self.version % every == 0:
            self._verify(group)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "replica": self.replica, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        # Loading restores parameters and replicas together: the parameters' new version
        # counters are the reference from here on.
        self.note_optimizer_step()
        replica, last = state.get("replica"), state.get("last")
        self.replica = None if replica is None else replica.detach().clone()
        self._last = None if last is None else last.detach().clone()
