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


def _weight_codec(w: WeightComm) -> RowCodec:
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
        self.codec = _weight_codec(config.weights)
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
        gathered = torch.empty(world, send.shape[1], dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        intra, inter = self.topology.peers()
        METER.record_peers("weights", send.numel(), n, intra, inter)
        values = self.codec.decode(gathered, n)
        output_tensor.view(world, n).copy_(values)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        self._last = None


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
        self.codec = _weight_codec(config.weights)
        self.version = 0
        self.replica: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the replica: the next gather re-establishes it with exact values."""
        self.replica = None
        self._last = None

    def _agree_changed(self, changed: bool, device: torch.device, group) -> bool:
        flag = torch.tensor([1 if changed else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        intra, inter = self.topology.peers()
        METER.record_peers("control", flag.element_size(), 0, intra, inter)
        return bool(flag.item())

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._check_group(group)
        n = input_tensor.numel()
        world, rank = self.topology.world_size, self.topology.rank
        if n < max(1, self.config.min_shard_numel):
            self._plain(output_tensor, input_tensor, group)
            return None
        shard = input_tensor.detach()
        if self.replica is None or self.replica.numel() != output_tensor.numel() or self.replica.dtype != output_tensor.dtype:
            self._plain(output_tensor, shard, group)
            self.replica = output_tensor.detach().clone()
            self._last = shard.clone()
            return None
        changed = not torch.equal(self._last, shard)
        if not self._agree_changed(changed, shard.device, group):
            output_tensor.copy_(self.replica)
            return None
        self.version += 1
        replica_rows = self.replica.view(world, n)
        diff = shard.float() - replica_rows[rank].float()
        seed = derive_seed(self.config.seed, self.comm_id, self.version, rank, 2)
        send = self.codec.encode(diff.view(1, n), seed=seed)
        gathered = torch.empty(world, send.shape[1], dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        intra, inter = self.topology.peers()
        METER.record_peers("weights", send.numel(), n, intra, inter)
        deltas = self.codec.decode(gathered, n)
        # ``shard`` is a view of ``output_tensor``: remember it before the output is overwritten.
        self._last.copy_(shard)
        replica_rows.copy_((replica_rows.float() + deltas).to(self.replica.dtype))
        output_tensor.copy_(self.replica)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "replica": self.replica, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        replica, last = state.get("replica"), state.get("last")
        self.replica = None if replica is None else replica.detach().clone()
        self._last = None if last is None else last.detach().clone()
