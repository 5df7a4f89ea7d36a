"""A few numbers the host knows, moved to the device and back without draining the device.

A blocking copy between host and CUDA memory (``torch.tensor(values, device=cuda)``, ``.item()``,
``.tolist()`` of a CUDA tensor) waits for every kernel queued before it on the stream. The
version-counter agreement of the weight-difference gathers needs a handful of host integers
reduced across ranks; taken on the compute stream at the start of forward, that wait would
drain the optimizer step before the first gather can be queued. Here the numbers travel through
pinned memory on a side stream that waits for nothing queued before it, so the host waits for
the tiny exchange alone while the device goes on with its work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .collectives import all_reduce

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, without a host sync: on CUDA an asynchronous copy
    from pinned memory (the caching host allocator keeps it until the copy is done)."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def all_reduce_values(values: Sequence[int], op: dist.ReduceOp, group: dist.ProcessGroup | None,
                      device: torch.device) -> list[int]:
    """``values`` (int32, the same count on every rank) reduced with ``op`` over ``group``, on the
    host. Collective. On CUDA the exchange runs on a side stream with pinned buffers and the host
    waits for its event only, not for the kernels already queued on the device's streams."""
    if device.type != "cuda":
        flat = torch.tensor(values, dtype=torch.int32, device=device)
        all_reduce(flat, group if group is not None else dist.group.WORLD, op)
        return flat.tolist()
    stream = _side_stream(device)
    with torch.cuda.stream(stream):
        flat = to_device(values, torch.int32, device)
        all_reduce(flat, group if group is not None else dist.group.WORLD, op)
        back = torch.empty(flat.shape, dtype=torch.int32, pin_memory=True)
        back.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return back.tolist()
