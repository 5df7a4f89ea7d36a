"""Which parameter shards were modified in place, and when.

Every in-place change of a tensor (an optimizer step, ``load_state_dict``'s ``copy_``, a user's
``weight.mul_(0)``) bumps its version counter. The weight-difference gather compares the
counters of its FSDP group's shards at each gather with those recorded after the last optimizer
step: a difference means the parameters changed outside the optimizer, so the replicas are
re-established with exact values instead of a 4-bit difference of a possibly large jump.
The counter is ``Tensor._version``, torch's own bookkeeping for autograd; it is read here only.
"""

from __future__ import annotations

import torch
from torch import nn


def versions(params: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``params``. For FSDP2's DTensor parameters this is the DTensor's
    own counter: in-place ops on the DTensor bump it (its local tensor's counter does not move)."""
    return tuple(p._version for p in params)


def managed_parameters(module: nn.Module, fsdp_modules: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``module``'s subtree that no nested FSDP module in ``fsdp_modules`` owns:
    the ones in ``module``'s own FSDP group."""
    nested = [m for m in fsdp_modules if m is not module and any(m is x for x in module.modules())]
    owned_elsewhere = {id(p) for m in nested for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in owned_elsewhere]
