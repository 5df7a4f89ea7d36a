"""Weight all-gathers with FSDP2's custom comm interface.

FSDP2 calls ``allocate(size, dtype=, device=)`` for the flat unsharded buffer, copies this
rank's shard into its slice (``input_tensor`` is that view of ``output_tensor``), then calls
``comm(output_tensor, input_tensor, group, async_op)`` and copies the parameters out of
``output_tensor``. Each class here fills ``output_tensor`` on every rank and returns ``None``
(the work is done when the call returns).

Whether a shard changed is known on the host (:mod:`qsdp.comm.versions`): no gather compares
tensors or waits for the device, except the weight-difference gathers' one agreement per
optimizer step.
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
from .versions import ChangeTracker, versions
from .wire import RowCodec


class _Base:
    """Allocation and bookkeeping shared by the weight all-gathers.

    ``tracker``: the change bookkeeping shared by the gathers of one model (``quantize_comms``
    passes one). A comm built without one takes every gather for a new version of the shard.
    """

    def __init__(
        self, config: QuantConfig, topology: Topology, comm_id: int, tracker: ChangeTracker | None = None
    ) -> None:
        self.config = config
        self.topology = topology
        self.comm_id = comm_id
        self.tracker = tracker if tracker is not None else ChangeTracker(assume_changed=True)
        self.index = self.tracker.add()
        self.name = f"group {comm_id}"

    def track(self, params: list[torch.Tensor], name: str) -> None:
        """Watch ``params`` (the group's sharded parameters) for changes."""
        self.tracker.watches[self.index].params = list(params)
        self.tracker.watches[self.index].rebase()
        self.name = name

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

    def _gather_bytes(
        self, send: torch.Tensor, elements: int, group: dist.ProcessGroup, peers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """All-gather this rank's encoded row ``[1, B]`` into ``[group size, B]``, metered as
        ``elements`` weights sent to ``peers`` (intra, inter; default: the whole topology)."""
        size = dist.get_world_size(group)
        gathered = torch.empty(size, send.shape[1], dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        METER.record_peers("weights", send.numel(), elements, *(peers or self.topology.peers()))
        return gathered

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.watches[self.index].rebase()

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
    *version*, bumped when an optimizer step or any other in-place change touched the group's
    parameters (their counters, read on the host), so the forward and backward gathers of one
    step produce bit-identical weights. Only the sender's seed matters: no agreement is needed.
    """

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int,
                 tracker: ChangeTracker | None = None) -> None:
        super().__init__(config, topology, comm_id, tracker)
        self.codec = weight_codec(config.weights)
        self.version = 0
        self._seen: tuple | None = None  # the change token at the last gather

    def _token(self) -> tuple:
        return self.tracker.steps, versions(self.tracker.watches[self.index].params)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._check_group(group)
        n = input_tensor.numel()
        if n < max(1, self.config.min_shard_numel):
            self._plain(output_tensor, input_tensor, group)
            return None
        token = self._token()
        if token != self._seen or self.tracker.assume_changed:
            self.version += 1
            self._seen = token
        world, rank = self.topology.world_size, self.topology.rank
        seed = derive_seed(self.config.seed, self.comm_id, self.version, rank, 1)
        send = self.codec.encode(input_tensor.detach().view(1, n), seed=seed)
        gathered = self._gather_bytes(send, n, group)
        self.codec.decode_into(gathered, n, output_tensor.view(world, n))
        return None

    def state_dict(self) -> dict[str, Any]:
        # Whether the shard changed since its last gather: a resumed run must bump the version
        # (and the rounding) exactly where the original did.
        return {"version": self.version, "changed": self._token() != self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.version = int(state.get("version", 0))
        self._seen = None if state.get("changed", True) else self._token()


from .difference import DifferenceAllGather  # noqa: E402  (it builds on _Base)

__all__ = ["PlainAllGather", "QuantizedAllGather", "DifferenceAllGather", "weight_codec"]
