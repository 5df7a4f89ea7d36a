"""What a quantized weight gather of one shard shape does, fixed at its first call.

A steady gather (FSDP2 calls one per group, twice a step) is its launches and collectives; what
the config, the shard's size and dtype and the topology fix is worked out once here: the row
layout, the sizes of the buffers, how many ranks the rows travel to and the meter's entries.
The call adds only what changes: the version and the tensors; where its first call's encoding
and decoding were one kernel launch each, a later call launches those again with its own tensors
(:attr:`GatherPlan.launches`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..codecs.dispatch import disabled
from .collectives import all_gather
from .meter import peer_entries
from .row_layout import RowLayout
from .wire import RowCodec, _padding_from, _tk, launch_keys, one_launch, takes_keys


@dataclass(frozen=True)
class GatherPlan:
    """``layout``: the codec's row of the shard; ``rows``: rows of the gathered bytes (the
    ranks of the group the encoded rows travel over); ``width``: bytes of one encoded
    row; ``meter``: the meter's entries of the encoded row (:meth:`ByteMeter.add`);
    ``used``: where an encoded row's 4-byte padding starts (``None``: it has none);
    ``launches``: the first call's (encoding, decoding) launches where each was one
    (kernels.Launch), else empty; ``fused``: whether the codec takes the fused path;
    ``seeds``: the encoding's seed of each version (rng.CallSeeds)."""

    layout: RowLayout
    rows: int
    width: int
    meter: tuple
    used: int | None = None
    fused: bool = False
    launches: list = field(default_factory=list)
    seeds: Any = None
    keys: Any = None  # the encoding's key of each version, as its launch takes it (where fused)

    @classmethod
    def build(cls, comm, codec: RowCodec, n: int, device: torch.device, peers: tuple[int, int],
              rows: int, seed_tail: tuple[int, ...]) -> "GatherPlan":
        """The plan of ``comm``'s gather of an ``n``-element shard on ``device`` whose encoded rows
        travel over a group of ``rows`` ranks to ``peers`` (intra, inter) of this one; a
        version's seed is ``comm.seed(version, *seed_tail)``."""
        layout = comm.layouts.get(n, codec.unit, device)
        width = codec.row_nbytes(layout.wire_length)
        fused = layout.identity and codec.fuses_rows(torch.empty(0, dtype=torch.uint8, device=device))
        seeds = comm.call_seeds(seed_tail)
        return cls(layout, rows, width, peer_entries("weights", width, n, *peers),
                   _padding_from(codec, layout.wire_length), fused, seeds=seeds,
                   keys=launch_keys(seeds, codec.rounding) if fused else None)

    def again(self, shard: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether a call from ``shard`` into ``out`` launches the first call's kernels again
        (:meth:`encode_again`, :meth:`decode_again`): both contiguous."""
        if not self.launches or disabled():
            return False
        return shard.is_contiguous() and out.is_contiguous()

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

    def encode_again(self, shard: torch.Tensor, key: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`encode` by the first call's launch (``shard``, ``base``: contiguous, any shape;
        ``key``: the version's, from :attr:`keys`)."""
        send = torch.empty(1, self.width, dtype=torch.uint8, device=shard.device)
        if self.used is not None:
            send[:, self.used:].zero_()  # the row's 4-byte padding, as the encoding zeroes it
        _tk().quantize_again(self.launches[0], shard, send, key, base)
        return send

    def gather(self, comm, send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Every rank's encoded row over ``group``, ``[rows, width]``, metered."""
        gathered = torch.empty(self.rows, self.width, dtype=torch.uint8, device=send.device)
        all_gather(gathered, send, group)
        comm.byte_meter.add(self.meter)
        return gathered

    def decode_again(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """The first call's decoding launch into ``out`` (contiguous, any shape) from ``gathered``."""
        _tk().dequantize_again(self.launches[1], gathered, out)

    def keep(self, encoded: list, decoded: list) -> None:
        """Keep the first call's launches (:func:`~qsdp.comm.wire.recording` of its encoding and
        its decoding) where each was one."""
        launches = (one_launch(encoded), one_launch(decoded))
        if self.fused and None not in launches and takes_keys(self.keys, launches[0]):
            self.launches[:] = launches
