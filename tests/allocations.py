"""Watching what torch operations allocate, for tests that bound a hot path's temporaries.

Every tensor an aten operation returns is observed through a ``TorchDispatchMode`` (the
operations run unchanged); a storage not seen before is an allocation.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Allocations(TorchDispatchMode):
    """Records ``(op, dtype, bytes)`` of every new storage an operation returns."""

    def __init__(self, *known: torch.Tensor):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.new: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.new.append((str(func), t.dtype, t.untyped_storage().nbytes()))
        return out

    def largest(self, *dtypes: torch.dtype) -> int:
        return max((b for _, d, b in self.new if d in dtypes), default=0)
