"""A fingerprint of a group's shards: what tells a change the version counters cannot see.

A write through ``.data`` or ``set_``, through another view, from outside Python, or by one of
torch's ``_foreach_*`` in-place ops on a DTensor (an EMA's ``torch._foreach_lerp_``) changes a
parameter's values without bumping a counter the host can read. Two exact integer sums of the
shards' bits (a plain one and a position-weighted one, so that a change that keeps the sum, such
as two values swapped, still shows) make a fingerprint that moves with any such change.

It is read on the host (one read for every group at once): on a GPU that waits for the work
queued before it, so it is taken only where the cost is accepted, at an evaluation's forward
(:meth:`qsdp.comm.versions.ChangeTracker.at_forward`).
"""

from __future__ import annotations

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``p``: a DTensor's local shard (``to_local``, a view), or ``p``."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()


def _sums(p: torch.Tensor) -> torch.Tensor:
    """``[sum of the bits, position-weighted sum of the bits]`` of ``p``, as int64 on its device."""
    local = _local(p).contiguous().view(-1)
    if local.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=local.device)
    bits = local.view(_INT[local.element_size()]).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) % 65521
    return torch.stack([bits.sum(), (bits * weights).sum()])


def fingerprints(groups: list[list[torch.Tensor]]) -> list[tuple[int, ...]]:
    """One fingerprint (a tuple of ints) for each group of parameters, in one host read."""
    with torch.no_grad():
        sums = [torch.cat([_sums(p) for p in params]) if params else None for params in groups]
        present = [s for s in sums if s is not None]
        if not present:
            return [() for _ in groups]
        flat = torch.cat([s.to(present[0].device) for s in present]).tolist()
    out, at = [], 0
    for s in sums:
        k = 0 if s is None else s.numel()
        out.append(tuple(flat[at:at + k]))
        at += k
    return out
