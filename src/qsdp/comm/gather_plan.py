"""What a quantized weight gather of one shard shape does, fixed at its first call.

A steady gather (FSDP2 calls one per group, twice a step) is its launches and collectives; what
the config, the shard's size and dtype and the topology fix is worked out once here: the row
layout, the sizes of the buffers, how many ranks the rows travel to and the meter's entries.
The call adds only what changes: the version and the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .row_layout import RowLayout
from .wire import RowCodec


@dataclass(frozen=True)
class GatherPlan:
    """``layout``: the codec's row of the shard; ``rows``: rows of the gathered bytes (the
    ranks of the group the encoded rows travel over); ``width``: bytes of one encoded
    row; ``meter``: the meter's entry of the encoded row (bytes, elements, intra and inter
    peers)."""

    layout: RowLayout
    rows: int
    width: int
    meter: tuple[int, int, int, int]

    @classmethod
    def build(cls, comm, codec: RowCodec, n: int, device: torch.device, peers: tuple[int, int],
              rows: int) -> "GatherPlan":
        """The plan of ``comm``'s gather of an ``n``-element shard on ``device`` whose encoded rows
        travel over a group of ``rows`` ranks to ``peers`` (intra, inter) of this one."""
        layout = comm.layouts.get(n, codec.unit, device)
        width = codec.row_nbytes(layout.wire_length)
        return cls(layout, rows, width, (width, n, *peers))

    def encode(self, codec: RowCodec, shard: torch.Tensor, seed: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """The encoded row of ``shard`` (``[1, n]``; minus ``base`` where given, in one pass on
        the fused path), laid out as :attr:`layout` says."""
        layout = self.layout
        if not layout.identity:
            shard = layout.expand(shard)
            base = None if base is None else layout.expand(base)
        if base is None:
            return codec.encode(shard, seed=seed)
        return codec.encode_difference(shard, base, seed=seed)

    def gather(self, comm, send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Every rank's encoded row over ``group``, ``[rows, width]``, metered."""
        gathered = torch.empty(self.rows, self.width, dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        comm.byte_meter.record_peers("weights", *self.meter)
        return gathered
