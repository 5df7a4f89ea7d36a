"""Weight all-gathers with FSDP2's custom comm interface.

FSDP2 calls ``allocate(size, dtype=, device=)`` for the flat unsharded buffer, copies this
rank's shard into its slice (``input_tensor`` is that view of ``output_tensor``), then calls
``comm(output_tensor, input_tensor, group, async_op)`` and copies the parameters out of
``output_tensor``. Each class here fills ``output_tensor`` on every rank and returns ``None``
(the work is done when the call returns).

Whether a shard changed is known on the host (:mod:`qsdp.comm.versions`): no gather compares
tensors or waits for the device, except the weight-difference gathers' one agreement per
forward (and the fingerprint of :mod:`qsdp.comm.fingerprint` where the counters may miss a change).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..config import QuantConfig
from .base import WeightAllGather
from .difference import DifferenceAllGather
from .gather_plan import GatherPlan
from .topology import Topology
from .versions import ChangeTracker, versions
from .weight_codec import weight_codec
from .wire import recording


class PlainAllGather(WeightAllGather):
    """The ``fsdp`` preset: the same all-gather FSDP2 does by default, metered."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        if not self.handled_elsewhere(output_tensor, input_tensor, group, async_op):
            self.plain(output_tensor, input_tensor, group)
        return None


class QuantizedAllGather(WeightAllGather):
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

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        if self.handled_elsewhere(output_tensor, input_tensor, group, async_op):
            return None
        n = input_tensor.numel()
        if not self.config.quantizes_shard(n):
            self.plain(output_tensor, input_tensor, group)
            return None
        token = self._token()
        if token != self._seen or self.tracker.assume_changed:
            self.version += 1
            self._seen = token
        # Everything fixed by the shard's size, dtype and device, the group and the config is
        # planned at the first call; a steady call launches its first call's kernels again.
        key = (n, input_tensor.dtype, input_tensor.device)
        plan = self._plans.get(key)
        if plan is None:
            topo = self.topology
            plan = self._plans[key] = GatherPlan.build(
                self, self.codec, n, input_tensor.device, topo.peers(), topo.world_size, (topo.rank, 1))
        if plan.again(input_tensor, output_tensor) and output_tensor.numel() == plan.rows * n:
            key = plan.keys(self.version)[0]
            plan.decode_again(plan.gather(self, plan.encode_again(input_tensor, key), group), output_tensor)
            return None
        seed = plan.seeds(self.version)[0]
        learn = plan.fused and not plan.launches
        with recording(learn) as encoded:
            send = plan.encode(self.codec, input_tensor.detach().view(1, n), seed)
        gathered = plan.gather(self, send, group)
        with recording(learn) as decoded:
            self.codec.decode_into(gathered, plan.layout.wire_length, output_tensor.view(plan.rows, n),
                                   columns=plan.layout.position)
        if learn:
            plan.keep(encoded, decoded)
        return None

    def state_dict(self) -> dict[str, Any]:
        # Whether the shard changed since its last gather: a resumed run must bump the version
        # (and the rounding) exactly where the original did.
        return {"version": self.version, "changed": self._token() != self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.version = int(state.get("version", 0))
        self._seen = None if state.get("changed", True) else self._token()


__all__ = ["PlainAllGather", "QuantizedAllGather", "DifferenceAllGather"]
