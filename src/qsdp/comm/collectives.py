"""The two torch collectives whose names changed across the supported torch releases.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 may lack the new names. One place
picks whichever exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
    """Every rank's ``input_tensor`` concatenated into ``output`` (rank order)."""
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(output, input_tensor, group=group)
    else:
        dist.all_gather_into_tensor(output, input_tensor, group=group)


def reduce_scatter_flat(output: torch.Tensor, input_tensor: torch.Tensor, op, group) -> None:
    """Chunk ``r`` of ``input_tensor`` reduced over ranks into rank ``r``'s ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(output=output, input=input_tensor, op=op, group=group)
    else:
        dist.reduce_scatter_tensor(output, input_tensor, op=op, group=group)
