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


def _butterfly_into(rows: torch.Tensor, block: int, out: torch.Tensor, scratch: list[torch.Tensor]) -> None:
    """``out = rows @ H`` for fp32 ``rows`` and ``out`` of ``[N, block]``, in the fixed butterfly
    order; ``scratch``: two buffers of at least ``rows.numel()`` elements (``rows`` is not
    modified).

    The stages run on the transpose, ``[block, N]``: the two halves of every stage are then runs
    of ``h * N`` contiguous elements instead of runs of ``h`` (strided elementwise ops are several
    times slower than contiguous ones). Each output element is still the same sums in the same
    order."""
    n_rows = rows.shape[0]
    bufs = [b[: rows.numel()].view(block, n_rows) for b in scratch]
    bufs[0].copy_(rows.t())
    cur, h, i = bufs[0], 1, 1
    while h < block:
        src = cur.view(block // (2 * h), 2, h, n_rows)
        dst = bufs[i].view(block // (2 * h), 2, h, n_rows)
        torch.add(src[:, 0], src[:, 1], out=dst[:, 0])
        torch.sub(src[:, 0], src[:, 1], out=dst[:, 1])
        cur, h, i = bufs[i], 2 * h, 1 - i
    out.copy_(cur.t())


def _apply(x: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    _check_block(block)
    flat = x.reshape(-1).float()
    n = flat.numel()
    n_rows = n // block
    out = torch.empty_like(flat)
    if n_rows * block < n:
        out[n_rows * block :] = flat[n_rows * block :]
    step = max(1, _CHUNK // block) if flat.device.type == "cpu" else max(n_rows, 1)
    scratch = [flat.new_empty(min(n_rows, step) * block) for _ in range(2)]
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        dst = out[r0 * block : r1 * block].view(-1, block)
        _butterfly_into(flat[r0 * block : r1 * block].view(-1, block), block, dst, scratch)
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
