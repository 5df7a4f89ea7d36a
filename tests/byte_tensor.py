"""A parameter whose FSDP2 all-gather carries raw bytes: the smallest all-gather extension.

FSDP2 calls ``fsdp_pre_all_gather`` on each rank's shard for the tensors to gather and
``fsdp_post_all_gather`` on the gathered ones for the unsharded parameter. :class:`BytesWeight`
sends its fp32 shard as uint8 and views the gathered bytes back as fp32, so a correct gather gives
exactly the unsharded weights, and any arithmetic on the bytes shows in them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


class BytesWeight(torch.Tensor):
    """An fp32 tensor that FSDP2 all-gathers as its bytes (``torch.uint8``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        # Every op runs on the inner tensor; results stay wrapped so that FSDP2's shards (slices,
        # padding, copies) and the optimizer's updates keep the extension.
        unwrap = lambda t: t._data  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return BytesWeight(inner_tensors["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> tuple[tuple[torch.Tensor, ...], Any]:
        return (self._data.contiguous().view(torch.uint8),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (raw,) = all_gather_outputs
        if out is not None:
            # Later gathers refill the same storage, which the unsharded parameter views.
            assert out.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
            return None
        return raw.view(torch.float32), (raw,)
