"""Blockwise Walsh-Hadamard transform (SDP4Bit's gradient smoothing).

The flat tensor is cut into contiguous blocks of ``block`` elements and each block is multiplied
by the unnormalized Sylvester Hadamard matrix (entries +-1). ``H @ H = block * I``, so the
inverse is the same product scaled by ``1 / block``. Spreading an outlier over its block lowers
the absmax of the block's quantization groups and so the error of every other element.

The product is computed as a radix-2 butterfly in a fixed order (stage ``k`` combines the
elements whose in-block index differs in bit ``k``, ``k = 0, 1, ...``: ``(a, b) -> (a + b,
a - b)``), not as a matrix multiplication, whose summation order belongs to the BLAS library and
the device. Every step is one IEEE addition or subtraction, so the result is the same on every
device and the fused Triton kernels (:mod:`qsdp.codecs.triton_kernels`) reproduce it bit for bit.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"hadamard block={block!r} must be a power of two >= 2")


@functools.lru_cache(maxsize=16)
def _matrix_cpu(block: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(block: int, *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The ``block x block`` Sylvester Hadamard matrix with +-1 entries."""
    _check_block(block)
    # copy=True: never hand out the cached tensor itself (a caller mutating it would corrupt
    # every later transform).
    return _matrix_cpu(block).to(dtype=dtype, device=device, copy=True)


# Elements a CPU chunk of the transform holds: its two scratch buffers (512 KiB each) stay in
# cache through the log2(block) stages instead of each stage streaming the whole tensor from
# memory; smaller chunks lose to torch's per-operation overhead.
_CHUNK = 1 << 17
# The plans a CPU thread keeps (:func:`_plan`): those of chunks of at most _PLAN_MOST elements,
# where making a plan (its stage views) costs as much as the arithmetic or more. Measured on one
# core, with the plan made at each call and kept: 130 to 170 us and 51 us for 4096 elements,
# 166 to 209 us and 79 to 93 us for 16384, 272 to 313 us and 201 to 233 us for 65536. The
# _PLANS_KEPT used last, each with two scratch buffers of its chunk: at most 2 MiB a thread.
_PLAN_MOST = 1 << 14
_PLANS_KEPT = 16


class _Butterfly:
    """The stages of ``rows @ H`` for ``[n_rows, block]`` fp32 rows, in the fixed butterfly
    order, run in two scratch buffers of at least ``n_rows * block`` elements.

    The stages run on the transpose, ``[block, N]``: the two halves of every stage are then runs
    of ``h * N`` contiguous elements instead of runs of ``h`` (strided elementwise ops are several
    times slower than contiguous ones). Each output element is still the same sums in the same
    order. Every view a stage reads or writes is made here, once: on a small shard each one
    costs what a stage's arithmetic does."""

    built = 0  # plans made in this process (the tests count them)

    def __init__(self, n_rows: int, block: int, scratch: list[torch.Tensor]) -> None:
        type(self).built += 1
        bufs = [b[: n_rows * block].view(block, n_rows) for b in scratch]
        self.first = bufs[0]
        # (a, b, a + b, a - b) of each stage: the halves whose in-block index differs in bit k.
        self.stages: list[tuple[torch.Tensor, ...]] = []
        cur, h, i = 0, 1, 1
        while h < block:
            src = bufs[cur].view(block // (2 * h), 2, h, n_rows)
            dst = bufs[i].view(block // (2 * h), 2, h, n_rows)
            self.stages.append((src[:, 0], src[:, 1], dst[:, 0], dst[:, 1]))
            cur, h, i = i, 2 * h, 1 - i
        self.last = bufs[cur]

    def __call__(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out = rows @ H`` (``rows`` is not modified)."""
        self.first.copy_(rows.t())
        for a, b, total, difference in self.stages:
            torch.add(a, b, out=total)
            torch.sub(a, b, out=difference)
        out.copy_(self.last.t())


class _CpuPlans(threading.local):
    """A CPU thread's butterfly plans, by ``(n_rows, block)``, each with its own scratch, the
    least recently used dropped past :data:`_PLANS_KEPT`. Per thread: two threads transforming
    at once must not share scratch."""

    def __init__(self) -> None:
        self.plans: OrderedDict[tuple[int, int], _Butterfly] = OrderedDict()


_CPU = _CpuPlans()


def _plan(n_rows: int, block: int, device: torch.device) -> _Butterfly:
    """The butterfly of ``[n_rows, block]`` rows on ``device``: for a small CPU chunk (at most
    :data:`_PLAN_MOST` elements) the thread's plan of that shape, made once; otherwise a plan
    over fresh scratch of the chunk's size, as each transform made before plans were kept."""
    size = n_rows * block
    if device.type != "cpu" or size > _PLAN_MOST:
        return _Butterfly(n_rows, block, [torch.empty(size, dtype=torch.float32, device=device) for _ in range(2)])
    key = (n_rows, block)
    plan = _CPU.plans.get(key)
    if plan is None:
        scratch = [torch.empty(size, dtype=torch.float32) for _ in range(2)]
        plan = _CPU.plans[key] = _Butterfly(n_rows, block, scratch)
        if len(_CPU.plans) > _PLANS_KEPT:
            _CPU.plans.popitem(last=False)
    else:
        _CPU.plans.move_to_end(key)
    return plan


def _apply(x: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    _check_block(block)
    flat = x.reshape(-1).float()
    n = flat.numel()
    n_rows = n // block
    out = torch.empty_like(flat)
    if n_rows * block < n:
        out[n_rows * block :] = flat[n_rows * block :]
    step = max(1, _CHUNK // block) if flat.device.type == "cpu" else max(n_rows, 1)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        dst = out[r0 * block : r1 * block].view(-1, block)
        _plan(r1 - r0, block, flat.device)(flat[r0 * block : r1 * block].view(-1, block), dst)
        if scale != 1.0:
            dst.mul_(scale)
    return out.view(x.shape)


def hadamard(x: torch.Tensor, *, block: int = 32) -> torch.Tensor:
    """Blockwise Hadamard transform of ``x`` (any shape), returned as float32 of the same shape.

    Elements of a trailing partial block (``numel % block`` of them) are left unchanged; the
    collectives pad their buffers to whole blocks so that none occur there.
    """
    return _apply(x, block, 1.0)


def inverse_hadamard(x: torch.Tensor, *, block: int = 32) -> torch.Tensor:
    """Inverse of :func:`hadamard`: the same transform scaled by ``1 / block``."""
    _check_block(block)  # before 1 / block: block=0 must be a ValueError, not ZeroDivisionError
    return _apply(x, block, 1.0 / block)
