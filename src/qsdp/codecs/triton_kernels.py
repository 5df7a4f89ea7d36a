"""Fused Triton kernels for the codec steps, bit-identical to the torch reference.

Two kernels, each one pass over memory:

* :func:`_quantize_kernel`: (optional ``x - y``) -> (optional blockwise Hadamard) -> group
  scales (absmax or min-max) -> rounding (nearest, stochastic, random shift) -> packed codes.
  It serves :func:`qsdp.codecs.quantize`, ``RowCodec.encode`` (Hadamard fused) and the weight
  difference ``RowCodec.encode_difference``.
* :func:`_dequantize_kernel`: unpack and dequantize ``K`` packed rows and sum them in fp32 (left to
  right), then either store (optionally after the inverse Hadamard, optionally cast to bf16/fp16,
  optionally added to the output: the replica update) or requantize them (the two-level middle
  step). It serves :func:`qsdp.codecs.dequantize` and ``RowCodec.decode`` / ``decode_into`` /
  ``decode_sum`` / ``decode_sum_encode``.

Program layout: program ``(t, r)`` handles packed row ``r`` (output row for the sums) and a tile
of ``GPP`` consecutive groups ``[t * GPP, (t + 1) * GPP)`` of that row, held as a ``[GPP, BG]``
register tile (``BG``: the group size rounded up to a power of two, columns past the group masked;
``GPP * BG`` about :data:`TILE` = 4096 elements, 8 warps; 4 warps for smaller tiles; e.g. group
128 -> 32 groups a program, group 2048 -> 2). The input is read once and codes, scales and zero
points written once. A group larger than :data:`MAX_TILE` is cut into ``NCH`` chunks of
``BG = MAX_TILE``: one program per group makes two passes over it (statistics, then codes; the
second mostly from L2) for quantization, one program per chunk for dequantization. Hadamard
blocks must lie inside a tile (:func:`fuses_hadamard`); otherwise the caller transforms first
with the reference butterfly (exact on any device) and quantizes with the kernel.

Exactness, operation by operation, against :mod:`qsdp.codecs.quantize`: divisions are IEEE
(``tl.div_rn``, never a reciprocal); ``torch.round`` is round-half-to-even (:func:`_rint`);
``floor`` avoids libdevice, which Triton links with flush-to-zero (:func:`_floor`); the
random numbers are :func:`qsdp.codecs.rng.uniform`'s hash in wrapping uint32 arithmetic, with the
key ``seed_key(seed, stream)`` computed on the host and the same indices (element index within the
padded flat tensor for ``stochastic``, group index for ``shift``); the Hadamard transform is the
reference's butterfly order; sums of rows go left to right as ``RowCodec``'s reference does;
bf16 rounding is done on the bits (round to nearest even, NaN -> 0x7FC0, as torch); kernels are
compiled with ``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA. A group
holding NaN or an infinity gets the wire format's non-finite encoding (scale and zero point
``quantize.NON_FINITE_BITS``, codes 0), chosen by an integer select as in the reference, so its
bytes do not depend on how the hardware's arithmetic treats a NaN's payload. Decoding such a group
gives NaN in every element, with the sign and payload the hardware gives.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import kernel_handles, rng
from .pack import SUPPORTED_BITS, packed_nbytes
from .usage import recorder

_ran_triton = recorder("triton")  # record_run("triton") without a Python frame

# Largest group (in elements) one program keeps in registers; larger groups are chunked.
MAX_TILE = 4096
# Elements per program for small groups (GPP = TILE // BG groups per program).
TILE = 4096
_ROUNDING = {"nearest": 0, "stochastic": 1, "shift": 2}
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Passed to every launch: no FMA contraction (the reference rounds every product).
_LAUNCH = {"enable_fp_fusion": False}
# CUDA's limit on the second grid dimension; more rows are launched in several grids.
_MAX_GRID_ROWS = 65535
# Context-manager factories entered around every kernel launch as ``(kernel, grid, args,
# kwargs)``: the launch census (:mod:`qsdp.bench.census`) counts launches where no GPU profiler
# runs, and leaves out what Triton's interpreter does on the host to run one. Empty in training.
launch_observers: list = []


def _steady(kernel, handles: list, k: int, grid: tuple, args: tuple, kwargs: dict, fresh: bool) -> None:
    """Launch ``kernel`` on grid ``k`` of a :class:`Launch` (``handles``: its handles): through
    the compiled kernel its first replay found where it fits, else through Triton's dispatch.
    ``fresh``: the launch was derived for this call; only a replay (a plan's launch given again)
    keeps what the dispatch found, so a launch derived at every call (a layout no plan replays)
    looks for no handle."""
    if launch_observers:
        _launch(kernel, grid, *args, **kwargs)
        return
    handle = handles[k]
    if handle and kernel_handles.launched(handle, args):
        return
    compiled = kernel[grid](*args, **kwargs)
    if handle is None and not fresh:
        handles[k] = kernel_handles.found(compiled, kernel, grid, args, kwargs) or False


def _launch(kernel, grid, *args, **kwargs) -> None:
    if not launch_observers:
        kernel[grid](*args, **kwargs)
        return
    with contextlib.ExitStack() as stack:
        for observe in launch_observers:
            stack.enter_context(observe(kernel, grid, args, kwargs))
        kernel[grid](*args, **kwargs)


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _mix32(x):
    # rng._mix32 on uint32 (multiplications wrap modulo 2**32, shifts are logical).
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform(idx, key):
    # rng.uniform: idx and key uint32; floats in [0, 1), multiples of 2**-24.
    x = _mix32(idx * 0x9E3779B1 + key)
    x = _mix32(x ^ key)
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _slice_key(prefix, j, KEY_TERM: tl.constexpr):
    # The rounding key of rounding slice j (uint32): rng.seed_key(rng.derive_seed(*parts, j),
    # stream) where prefix = rng.derive_seed(*parts) and KEY_TERM = the stream's term of
    # seed_key. derive_seed folds j in as seed_key(j ^ prefix, stream=len(str(j))); both
    # seed_key calls see a seed below 2**32, so each is mix(mix(seed ^ stream term)).
    j = j.to(tl.uint32)
    digits = (1 + (j >= 10).to(tl.uint32) + (j >= 100).to(tl.uint32) + (j >= 1000).to(tl.uint32)
              + (j >= 10000).to(tl.uint32) + (j >= 100000).to(tl.uint32) + (j >= 1000000).to(tl.uint32)
              + (j >= 10000000).to(tl.uint32) + (j >= 100000000).to(tl.uint32) + (j >= 1000000000).to(tl.uint32))
    seed = _mix32(_mix32(j ^ prefix ^ (digits * 0x9E3779B9)))
    return _mix32(_mix32(seed ^ KEY_TERM))


@triton.jit
def _floor(v):
    # floor without libdevice: Triton links libdevice with FTZ on, and its floor flushes a
    # negative denormal to -0 instead of -1. |v| >= 2**23 (and inf, NaN) is integral already.
    t = v.to(tl.int32).to(tl.float32)
    t = tl.where(t > v, t - 1.0, t)
    return tl.where(tl.abs(v) < 8388608.0, t, v)


@triton.jit
def _rint(v):
    # torch.round: round half to even (up to the sign of a zero result, which no code sees).
    f = _floor(v)
    d = v - f
    odd = (f - 2.0 * _floor(f * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _widen(raw, KIND: tl.constexpr):
    # KIND 0: fp32, 1: bf16 (passed as int16 bits, widened exactly by hand), 2: fp16.
    if KIND == 1:
        return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _kind_ptr(ptr, KIND: tl.constexpr):
    # A pointer to values of KIND as the kernels read and write them: bf16 as its int16 bits
    # (the host passes bf16 tensors as they are, no int16 view made a launch).
    if KIND == 1:
        return ptr.to(tl.pointer_type(tl.int16))
    else:
        return ptr


@triton.jit
def _f32_ptr(ptr):
    # Scales and zero points: fp32 words inside the packed rows' uint8 buffer (the host passes
    # the buffer itself, no fp32 view made a launch) or fp32 tensors of their own.
    return ptr.to(tl.pointer_type(tl.float32))


@triton.jit
def _to_kind(v, KIND: tl.constexpr):
    # fp32 -> the stored dtype, rounding to nearest even as torch's .to(dtype).
    if KIND == 1:
        b = v.to(tl.uint32, bitcast=True)
        r = (b + (((b >> 16) & 1) + 0x7FFF)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.int16)
    elif KIND == 2:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def _hadamard(v, R: tl.constexpr, C: tl.constexpr, HB: tl.constexpr, HB_LOG: tl.constexpr):
    # Blockwise Walsh-Hadamard of the [R, C] tile (C a multiple of HB, or R * C of HB with
    # consecutive rows forming blocks), in the reference's order: stage k combines the elements
    # whose in-block index differs in bit k. Each stage splits off the lowest index bit and puts
    # the (sum, difference) bit on top, so after HB_LOG stages the order is natural again.
    N: tl.constexpr = R * C // HB
    x = tl.reshape(v, [N, HB])
    for _ in tl.static_range(HB_LOG):
        a, b = tl.split(tl.reshape(x, [N, HB // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [N, HB])
    return tl.reshape(x, [R, C])


@triton.jit
def _stats(v, valid, SYMMETRIC: tl.constexpr):
    # Per group (row of the tile): (min, max) or (absmax, absmax), and whether a NaN was seen
    # (GPU max/min drop NaN; the reference's amax/amin propagate it).
    nan = tl.max(tl.where(valid & (v != v), 1, 0), axis=1)
    if SYMMETRIC:
        hi = tl.max(tl.where(valid, tl.abs(v), 0.0), axis=1)
        lo = hi
    else:
        hi = tl.max(tl.where(valid, v, float("-inf")), axis=1)
        lo = tl.min(tl.where(valid, v, float("inf")), axis=1)
    return lo, hi, nan


@triton.jit
def _non_finite(t, bad):
    # The wire format's non-finite scale / zero point (quantize.NON_FINITE_BITS) where bad,
    # selected on the bits: GPU arithmetic would give its own canonical NaN 0x7FFFFFFF.
    return tl.where(bad, 0x7FC00000, t.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_zero(lo, hi, nan, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
    # A group holding a NaN (flagged: GPU max/min drop it) or an infinity is non-finite: its
    # statistics are replaced by 0 before any arithmetic, its scale and zero point by the fixed
    # bits afterwards, and _codes gives it code 0 (it sees the NaN scale).
    bad = (nan > 0) | (hi == float("inf")) | (lo == float("-inf"))
    lo = tl.where(bad, 0.0, lo)
    hi = tl.where(bad, 0.0, hi)
    if SYMMETRIC:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        scale = tl.div_rn(hi, tl.full(hi.shape, QMAX, tl.float32))
        zero = tl.zeros_like(scale)
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        zero = lo + 0.0
        scale = tl.div_rn(hi + 0.0 - zero, tl.full(hi.shape, LEVELS, tl.float32))
        zero = _non_finite(zero, bad)
    return _non_finite(scale, bad), zero


@triton.jit
def _codes(v, scale, zero, e_idx, g_idx, key, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
           ROUNDING: tl.constexpr):
    # Integer codes (offset binary for symmetric) of the [GPP, BG] tile.
    s = tl.where(scale > 0, scale, 1.0)[:, None]
    if SYMMETRIC:
        t = tl.div_rn(v, tl.broadcast_to(s, v.shape))
    else:
        t = tl.div_rn(v - zero[:, None], tl.broadcast_to(s, v.shape))
    if ROUNDING == 0:
        r = _rint(t)
    elif ROUNDING == 1:
        r = _floor(t + _uniform(e_idx.to(tl.uint32), key))
    else:
        r = _floor(t + _uniform(g_idx.to(tl.uint32), key)[:, None])
    # The reference's clamp keeps a NaN quotient (inf / inf in a group with an infinite scale);
    # Triton's default min/max (PTX max.f32) would return the bound instead, on the GPU only
    # (Triton's interpreter keeps NaN either way). A NaN code is 0: what the reference's
    # float-to-uint8 conversion gives (x86, ARM and CUDA all convert NaN to 0 in the low byte).
    # A non-finite group (NaN scale, from _scale_zero's select) has every code 0.
    if SYMMETRIC:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        r = tl.clamp(r, -QMAX * 1.0, QMAX * 1.0, propagate_nan=tl.PropagateNan.ALL) + (QMAX + 1) * 1.0
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        r = tl.clamp(r, 0.0, LEVELS * 1.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.where((r == r) & (scale == scale)[:, None], r, 0.0).to(tl.int32)


@triton.jit
def _store_codes(ptr, c, byte0, gmask, col_lim, NCB, GPP: tl.constexpr, BG: tl.constexpr,
                 BITS: tl.constexpr):
    # Pack the [GPP, BG] codes little end first and store the bytes of each group at
    # byte0[group]; only bytes of the group's first col_lim columns and below NCB are written.
    PB: tl.constexpr = 8 // BITS
    if BITS == 8:
        b = c
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(c, [GPP, BG // 2, 2]))
        b = lo | (hi << 4)
    else:
        p, q = tl.split(tl.reshape(c, [GPP, BG // 4, 2, 2]))
        c0, c2 = tl.split(p)
        c1, c3 = tl.split(q)
        b = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)
    bcol = tl.arange(0, BG // PB)
    pos = byte0[:, None] + bcol[None, :]
    mask = gmask[:, None] & (bcol[None, :] * PB < col_lim) & (pos < NCB)
    tl.store(ptr + pos, b.to(tl.uint8), mask=mask)


@triton.jit
def _dequant_tile(codes_row, scales_row, zeros_row, g, gmask, c0, NCB, GS: tl.constexpr,
                  GPP: tl.constexpr, BG: tl.constexpr, BITS: tl.constexpr,
                  SYMMETRIC: tl.constexpr):
    # Values of columns [c0, c0 + BG) of groups g of one packed row, fp32 [GPP, BG].
    PB: tl.constexpr = 8 // BITS
    bcol = tl.arange(0, BG // PB)
    pos = g.to(tl.int64)[:, None] * (GS // PB) + (c0 // PB + bcol)[None, :]
    m = gmask[:, None] & (bcol[None, :] * PB < GS - c0) & (pos < NCB)
    b = tl.load(codes_row + pos, mask=m, other=0).to(tl.int32)
    if BITS == 8:
        c = b
    elif BITS == 4:
        c = tl.reshape(tl.join(b & 15, b >> 4), [GPP, BG])
    else:
        c = tl.reshape(tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6)), [GPP, BG])
    cf = c.to(tl.float32)
    scale = tl.load(scales_row + g, mask=gmask, other=0.0)
    if SYMMETRIC:
        HALF: tl.constexpr = 1 << (BITS - 1)
        return (cf - HALF * 1.0) * scale[:, None]
    else:
        zero = tl.load(zeros_row + g, mask=gmask, other=0.0)
        return cf * scale[:, None] + zero[:, None]


@triton.jit
def _load_values(x_row, y_row, e, L, X_KIND: tl.constexpr, Y_KIND: tl.constexpr,
                 GPP: tl.constexpr, BG: tl.constexpr, HB: tl.constexpr, HB_LOG: tl.constexpr):
    # Row elements e, the row padded past L by repeating its last element; minus y if Y_KIND >= 0;
    # Hadamard-transformed if HB > 0. (A masked contiguous load plus a select, rather than a
    # load at min(e, L - 1), keeps the loads vectorizable.)
    inside = e < L
    v = tl.where(inside, _widen(tl.load(x_row + e, mask=inside, other=0), X_KIND),
                 _widen(tl.load(x_row + (L - 1)), X_KIND))
    if Y_KIND >= 0:
        y = tl.where(inside, _widen(tl.load(y_row + e, mask=inside, other=0), Y_KIND),
                     _widen(tl.load(y_row + (L - 1)), Y_KIND))
        v = v - y
    if HB > 0:
        v = _hadamard(v, GPP, BG, HB, HB_LOG)
    return v


@triton.jit
def _tail_row(x_ptr, r, n, N):
    # Row r of a vector of N elements cut into rows of n: its first element and its length, the
    # rows past the end the vector's last element alone (so padded with it, as the reference pads).
    start = tl.minimum(r * n, N - 1)
    return x_ptr + start, tl.minimum(n, N - start)


@triton.jit
def _slice_at(k, SG, G, SW, code_off, GS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
    """Rounding slice k of a row of G groups in slices of SG, packed SW bytes a slice from
    code_off: (its groups, its first element, its code bytes, and where its codes, scales and zero
    points start: code_off of the codes in bytes, the others in fp32 words)."""
    G = tl.minimum(SG, G - k * SG)
    span = (k * SG).to(tl.int64) * GS
    NCB = G * (GS * BITS // 8)
    at = code_off + k.to(tl.int64) * SW
    scale_off = at // 4
    return G, span, NCB, at + G * (4 if SYMMETRIC else 8), scale_off, scale_off + G


@triton.jit
def _quantize_chunked(x_row, y_row, codes_row, gstart, gmask, cols, L, NC, NCB, row_start, g_idx, key32,
                      GS: tl.constexpr, BG: tl.constexpr, GPP: tl.constexpr, NCH: tl.constexpr,
                      BITS: tl.constexpr, SYMMETRIC: tl.constexpr, ROUNDING: tl.constexpr,
                      HB: tl.constexpr, HB_LOG: tl.constexpr, X_KIND: tl.constexpr, Y_KIND: tl.constexpr):
    """_quantize_kernel's group larger than a tile (one a program, GPP == 1): statistics over its
    chunks, then a second pass computes and stores the codes; returns (scale, zero)."""
    PB: tl.constexpr = 8 // BITS
    if SYMMETRIC:
        lo = tl.zeros([GPP], tl.float32)
        hi = tl.zeros([GPP], tl.float32)
    else:
        lo = tl.full([GPP], float("inf"), tl.float32)
        hi = tl.full([GPP], float("-inf"), tl.float32)
    nan = tl.zeros([GPP], tl.int32)
    for ch in range(NCH):
        cc = ch * BG + cols
        e = gstart[:, None] + cc[None, :]
        v = _load_values(x_row, y_row, e, L, X_KIND, Y_KIND, GPP, BG, HB, HB_LOG)
        clo, chi, cnan = _stats(v, (cc < GS)[None, :], SYMMETRIC)
        lo = tl.minimum(lo, clo)
        hi = tl.maximum(hi, chi)
        nan = tl.maximum(nan, cnan)
    scale, zero = _scale_zero(lo, hi, nan, BITS, SYMMETRIC)
    for ch in range(NCH):
        cc = ch * BG + cols
        e = gstart[:, None] + cc[None, :]
        v = _load_values(x_row, y_row, e, L, X_KIND, Y_KIND, GPP, BG, HB, HB_LOG)
        c = _codes(v, scale, zero, row_start + e, g_idx, key32, BITS, SYMMETRIC, ROUNDING)
        c = tl.where(e < NC, c, 0)
        _store_codes(codes_row, c, (gstart + ch * BG) // PB, gmask, GS - ch * BG, NCB, GPP, BG, BITS)
    return scale, zero


@triton.jit
def _requantize_store(acc, cols, e, g, gmask, first_group, key32, codes_row, scales_row, zeros_row, NCB,
                      GS: tl.constexpr, BG: tl.constexpr, GPP: tl.constexpr, BITS: tl.constexpr,
                      SYMMETRIC: tl.constexpr, ROUNDING: tl.constexpr):
    """_dequantize_kernel's MODE 1: the summed tile ``acc`` quantized again with the same groups
    into a packed row (its codes, scales and zero points at ``*_row``); ``first_group`` is the
    output row's first group index, where its random indices start."""
    PB: tl.constexpr = 8 // BITS
    lo, hi, nan = _stats(acc, (cols < GS)[None, :], SYMMETRIC)
    scale, zero = _scale_zero(lo, hi, nan, BITS, SYMMETRIC)
    c = _codes(acc, scale, zero, first_group * GS + e, first_group + g, key32, BITS, SYMMETRIC, ROUNDING)
    _store_codes(codes_row, c, g.to(tl.int64) * (GS // PB), gmask, GS, NCB, GPP, BG, BITS)
    tl.store(scales_row + g, scale, mask=gmask)
    if not SYMMETRIC:
        tl.store(zeros_row + g, zero, mask=gmask)


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["key", "slice0"])
def _quantize_kernel(
    x_ptr, y_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr,
    L, G, NC, NCB, x_rs, y_rs, code_rs, code_off, scale_rs, scale_off, zero_off, key, row0, SG, SW, slice0,
    GS: tl.constexpr, BG: tl.constexpr, GPP: tl.constexpr, NCH: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, ROUNDING: tl.constexpr,
    HB: tl.constexpr, HB_LOG: tl.constexpr, X_KIND: tl.constexpr, Y_KIND: tl.constexpr,
    SLICED: tl.constexpr = False, PERMUTED: tl.constexpr = False, KEY_TERM: tl.constexpr = 0,
    TAIL: tl.constexpr = False,
):
    """Row r has L input elements (x_ptr + r * x_rs), padded to G groups of GS by repeating the
    last one; its codes (NC of them: the rest of the last byte is zero) go to codes_ptr +
    code_off + r * code_rs, NCB bytes, its scales (zero points) to scales_ptr (zeros_ptr) +
    scale_off (zero_off) + r * scale_rs. Rows start at row0 (grids have at most 65535 rows).
    PERMUTED: row r reads input row order_ptr[r]. SLICED: the G groups are rounding slices of SG
    groups (the last may be shorter), program_id(2) the slice k, each quantized as a row of its
    own: its input from element k * SG * GS of the row, its packed row (scales, zero points,
    codes) at byte k * SW of the packed row from code_off (scale_off, zero_off ignored), its
    random indices its own, its key _slice_key(key, slice0 + k, KEY_TERM). TAIL: row r is the
    x_rs elements of one vector of L from element r * x_rs, cut short by its end (_tail_row)."""
    x_ptr, y_ptr = _kind_ptr(x_ptr, X_KIND), _kind_ptr(y_ptr, Y_KIND)
    scales_ptr, zeros_ptr = _f32_ptr(scales_ptr), _f32_ptr(zeros_ptr)
    row = tl.program_id(1).to(tl.int64) + row0
    src = tl.load(order_ptr + row).to(tl.int64) if PERMUTED else row
    if SLICED:
        # Rebind the row's bounds and places to the slice's: the code below is the unsliced one.
        k = tl.program_id(2)
        G, span, NCB, code_off, scale_off, zero_off = _slice_at(k, SG, G, SW, code_off, GS, BITS, SYMMETRIC)
        L = L - span
        NC = G * GS
        key32 = _slice_key(key.to(tl.uint32, bitcast=True), slice0 + k, KEY_TERM)
        x_row, y_row = x_ptr + src * x_rs + span, y_ptr + src * y_rs + span
    else:
        key32 = key.to(tl.uint32, bitcast=True)
        x_row, y_row = x_ptr + src * x_rs, y_ptr + src * y_rs
        if TAIL:  # (no base: y is unread)
            x_row, L = _tail_row(x_ptr, src, x_rs, L)
    g = tl.program_id(0) * GPP + tl.arange(0, GPP)
    gmask = g < G
    cols = tl.arange(0, BG)
    codes_row = codes_ptr + code_off + row * code_rs
    gstart = g.to(tl.int64) * GS
    row_start = row * G * GS
    g_idx = row * G + g
    PB: tl.constexpr = 8 // BITS
    if NCH == 1:
        e = gstart[:, None] + cols[None, :]
        v = _load_values(x_row, y_row, e, L, X_KIND, Y_KIND, GPP, BG, HB, HB_LOG)
        lo, hi, nan = _stats(v, (cols < GS)[None, :], SYMMETRIC)
        scale, zero = _scale_zero(lo, hi, nan, BITS, SYMMETRIC)
        c = _codes(v, scale, zero, row_start + e, g_idx, key32, BITS, SYMMETRIC, ROUNDING)
        c = tl.where(e < NC, c, 0)
        _store_codes(codes_row, c, gstart // PB, gmask, GS, NCB, GPP, BG, BITS)
    else:
        scale, zero = _quantize_chunked(x_row, y_row, codes_row, gstart, gmask, cols, L, NC, NCB, row_start, g_idx,
                                        key32, GS, BG, GPP, NCH, BITS, SYMMETRIC, ROUNDING, HB, HB_LOG,
                                        X_KIND, Y_KIND)
    tl.store(scales_ptr + scale_off + row * scale_rs + g, scale, mask=gmask)
    if not SYMMETRIC:
        tl.store(zeros_ptr + zero_off + row * scale_rs + g, zero, mask=gmask)


@triton.jit
def _store_out(acc, ptr, m, flag_ptr, OUT_KIND: tl.constexpr, ADD: tl.constexpr, DIV: tl.constexpr,
               WATCH: tl.constexpr):
    """_dequantize_kernel's MODE 0 store (see there)."""
    if ADD:
        acc = _widen(tl.load(ptr, mask=m, other=0), OUT_KIND) + acc
    if DIV:
        acc = tl.div_rn(acc, tl.full(acc.shape, DIV, tl.float32))
    stored = _to_kind(acc, OUT_KIND)
    tl.store(ptr, stored, mask=m)
    if WATCH:
        # The stored value, widened back: a finite fp32 that overflows the dtype counts too.
        v = _widen(stored, OUT_KIND)
        bad = m & ((v != v) | (tl.abs(v) == float("inf")))
        tl.atomic_max(flag_ptr, tl.max(bad.to(tl.int32)))


@triton.jit(do_not_specialize=["key", "slice0"])
def _dequantize_kernel(
    codes_ptr, scales_ptr, zeros_ptr, out_ptr, q_codes_ptr, q_scales_ptr, q_zeros_ptr,
    ROW_O, ROW_J, G, NCB, code_rs, code_off, scale_rs, scale_off, zero_off,
    L_OUT, out_rs, q_NCB, q_code_rs, q_code_off, q_scale_rs, q_scale_off, q_zero_off, key, row0,
    SG, SW, Q_SW, slice0, flag_ptr,
    K: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr, GPP: tl.constexpr, NCH: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, HB: tl.constexpr, HB_LOG: tl.constexpr,
    MODE: tl.constexpr, OUT_KIND: tl.constexpr, ADD: tl.constexpr,
    Q_BITS: tl.constexpr, Q_SYMMETRIC: tl.constexpr, Q_ROUNDING: tl.constexpr,
    SLICED: tl.constexpr = False, KEY_TERM: tl.constexpr = 0, DIV: tl.constexpr = 0, WATCH: tl.constexpr = False,
):
    """Output row o sums (left to right) the dequantized packed rows o * ROW_O + j * ROW_J,
    j < K, each of G groups of GS. MODE 0: optional inverse Hadamard (HB > 0), then stored to
    out_ptr + o * out_rs, first L_OUT columns, as OUT_KIND (added to what is there if ADD),
    divided by DIV first (in fp32, as ``torch.div``) where DIV is given (0: none); WATCH: a stored value that
    is NaN or infinite sets the int32 at flag_ptr to 1 (it is never cleared here).
    MODE 1: requantized (Q_BITS, Q_SYMMETRIC, Q_ROUNDING, same groups) into the q_* layout.
    Output rows start at row0. SLICED: as _quantize_kernel's, the packed rows' slices at byte
    k * SW (the requantized ones' at k * Q_SW), the output's at element k * SG * GS."""
    scales_ptr, zeros_ptr = _f32_ptr(scales_ptr), _f32_ptr(zeros_ptr)
    q_scales_ptr, q_zeros_ptr = _f32_ptr(q_scales_ptr), _f32_ptr(q_zeros_ptr)
    if MODE == 0:
        out_ptr = _kind_ptr(out_ptr, OUT_KIND)
    o = tl.program_id(1).to(tl.int64) + row0
    if SLICED:
        k = tl.program_id(2)
        # The requantized layout first: _slice_at takes the row's G, before the slice's rebinds it.
        q_g, q_span, q_NCB, q_code_off, q_scale_off, q_zero_off = _slice_at(
            k, SG, G, Q_SW, q_code_off, GS, Q_BITS, Q_SYMMETRIC)
        G, span, NCB, code_off, scale_off, zero_off = _slice_at(k, SG, G, SW, code_off, GS, BITS, SYMMETRIC)
        L_OUT = L_OUT - span
        out_ptr = out_ptr + span
        key32 = _slice_key(key.to(tl.uint32, bitcast=True), slice0 + k, KEY_TERM)
    else:
        key32 = key.to(tl.uint32, bitcast=True)
    pid = tl.program_id(0)
    ch = pid % NCH
    g = (pid // NCH) * GPP + tl.arange(0, GPP)
    gmask = g < G
    c0 = ch * BG
    row = o * ROW_O
    acc = _dequant_tile(codes_ptr + code_off + row * code_rs, scales_ptr + scale_off + row * scale_rs,
                        zeros_ptr + zero_off + row * scale_rs, g, gmask, c0, NCB,
                        GS, GPP, BG, BITS, SYMMETRIC)
    for j in range(1, K):
        row = o * ROW_O + j * ROW_J
        acc += _dequant_tile(codes_ptr + code_off + row * code_rs, scales_ptr + scale_off + row * scale_rs,
                             zeros_ptr + zero_off + row * scale_rs, g, gmask, c0, NCB,
                             GS, GPP, BG, BITS, SYMMETRIC)
    cols = c0 + tl.arange(0, BG)
    e = g.to(tl.int64)[:, None] * GS + cols[None, :]
    if MODE == 0:
        if HB > 0:
            acc = _hadamard(acc, GPP, BG, HB, HB_LOG) * (1.0 / HB)
        m = gmask[:, None] & (cols < GS)[None, :] & (e < L_OUT)
        _store_out(acc, out_ptr + o * out_rs + e, m, flag_ptr, OUT_KIND, ADD, DIV, WATCH)
    else:
        _requantize_store(acc, cols, e, g, gmask, o * G, key32, q_codes_ptr + q_code_off + o * q_code_rs,
                          q_scales_ptr + q_scale_off + o * q_scale_rs, q_zeros_ptr + q_zero_off + o * q_scale_rs,
                          q_NCB, GS, BG, GPP, Q_BITS, Q_SYMMETRIC, Q_ROUNDING)


# ----------------------------------------------------------------------------- host side


def supports(*, bits: int, group_size: int) -> bool:
    """Whether the kernels handle this scheme: every group must start on a byte boundary."""
    return bits in SUPPORTED_BITS and group_size >= 1 and group_size % (8 // bits) == 0


def fuses_hadamard(group_size: int, block: int) -> bool:
    """Whether a Hadamard block of ``block`` fits the kernels' group tiles: whole blocks inside a
    group, or (small power-of-two groups) whole groups inside a block."""
    if group_size % block == 0:
        return group_size <= MAX_TILE or MAX_TILE % block == 0
    return group_size < block and block % group_size == 0 and group_size & (group_size - 1) == 0 and block <= MAX_TILE


class Packed(NamedTuple):
    """Where the packed rows live: codes (uint8), scales and zero points (fp32 words: fp32 tensors,
    or the packed rows' uint8 buffer itself, read as fp32 by the kernels) of row ``r`` at
    ``codes[code_off + r * code_rs:]``, ``scales[scale_off + r * scale_rs:]`` and
    ``zeros[zero_off + r * scale_rs:]`` (offsets in elements, fp32 words for the scales and zero
    points); ``ncb`` code bytes per row. (A named tuple: built for
    every launch, where a frozen dataclass's field-by-field ``__init__`` costs microseconds.)"""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    code_off: int
    code_rs: int
    scale_off: int
    zero_off: int
    scale_rs: int
    ncb: int

    @classmethod
    def flat(cls, codes, scales, zeros, numel: int, bits: int) -> "Packed":
        """A :class:`~qsdp.codecs.QTensor`'s separate buffers, as one row."""
        return cls(codes, scales, scales if zeros is None else zeros, 0, 0, 0, 0, 0, packed_nbytes(numel, bits))

    @classmethod
    def rows(cls, buf: torch.Tensor, *, padded: int, bits: int, group_size: int, symmetric: bool) -> "Packed":
        """``RowCodec``'s rows: uint8 ``[R, W]``, each ``[fp32 scales][fp32 zero points if
        min-max][packed codes][zero padding to 4 bytes]`` for ``padded`` elements."""
        if not buf.is_contiguous():
            raise ValueError("packed rows must be contiguous")
        return cls(buf, buf, buf, *_rows_places(buf.shape[1], padded, bits, group_size, symmetric))

    @classmethod
    def sliced(cls, buf: torch.Tensor) -> "Packed":
        """Rows of rounding slices side by side (:class:`Slices`): uint8 ``[R, W]``, each row the
        ``RowCodec`` rows of its slices one after another; the kernels find each slice's parts."""
        if not buf.is_contiguous():
            raise ValueError("packed rows must be contiguous")
        width = buf.shape[1]
        return cls(buf, buf, buf, 0, width, 0, 0, width // 4, 0)


@functools.lru_cache(maxsize=4096)
def _rows_places(width: int, padded: int, bits: int, group_size: int, symmetric: bool) -> tuple[int, ...]:
    """:meth:`Packed.rows`'s offsets and strides, fixed by the row's shape and codec: computed once."""
    groups = padded // group_size
    return 4 * groups * (1 if symmetric else 2), width, 0, groups, width // 4, padded * bits // 8


class Slices(NamedTuple):
    """Rounding slices launched together, one grid axis: ``count`` slices of ``groups`` groups
    (the last may have fewer), each quantized as a row of its own with the seed
    ``rng.derive_seed(*parts, first + k)`` for slice ``k``, where ``prefix`` is
    ``rng.derive_seed(*parts)``. Their packed rows sit side by side (:meth:`Packed.sliced`),
    ``nbytes`` bytes for a full slice (``q_nbytes`` for the requantized ones).

    The kernel derives each slice's key from ``prefix`` and its index itself: a table of keys
    would be a host-to-device copy per call (blocking from pageable memory, or a pinned buffer
    to manage), and a fixed number of scalar key arguments would bound the slice count; two
    hash rounds per program cost nothing beside a tile's thousands of element hashes."""

    count: int
    groups: int
    first: int
    prefix: int
    nbytes: int
    q_nbytes: int = 0


def _key_term(rounding: str) -> int:
    """The stream's term of ``rng.seed_key`` for the rounding's random stream."""
    if rounding == "nearest":
        return 0
    stream = rng.STREAM_GROUP if rounding == "shift" else rng.STREAM_ELEMENT
    return (stream * 0x9E3779B9) & 0xFFFFFFFF


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(group_size: int, groups: int, hadamard_block: int = 0) -> tuple[int, int, int]:
    """(BG, GPP, NCH) for a row of ``groups`` groups."""
    if group_size > MAX_TILE:
        return MAX_TILE, 1, -(-group_size // MAX_TILE)
    bg = _next_pow2(group_size)
    need = hadamard_block // group_size if hadamard_block > group_size else 1
    gpp = min(max(1, TILE // bg), _next_pow2(max(1, groups)))
    return bg, max(gpp, need), 1


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


def _kind(t: torch.Tensor) -> int:
    return _kind_of(t.dtype)


def _kind_of(dtype: torch.dtype) -> int:
    try:
        return _KIND[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype} is not supported; allowed: float32, bfloat16, float16") from None


def _checked_tile(group_size: int, groups: int, hadamard_block: int) -> tuple[int, int, int]:
    """The launch tile (see :func:`_tile`), after checking that the Hadamard block can be fused."""
    if hadamard_block and not fuses_hadamard(group_size, hadamard_block):
        raise ValueError(f"hadamard block {hadamard_block} does not fit group size {group_size}")
    return _tile(group_size, groups, hadamard_block)


def _rounding_key(seed: int | None, rounding: str) -> int:
    """The host-side hash key of the rounding's random stream (the reference's ``seed_key``), as
    the int32 with its bits (:func:`_key_arg`)."""
    if rounding == "nearest":
        return 0
    return _key_arg(rng.seed_key(seed, rng.STREAM_GROUP if rounding == "shift" else rng.STREAM_ELEMENT))


def _key_arg(key: int) -> int:
    """A 32-bit key as the kernels take it: the int32 with its bits (read back as uint32).
    Triton types a Python int argument by its value, i32 below 2**31 and i64 above, even where
    ``do_not_specialize`` spares the value itself: random 32-bit keys passed as they are would
    compile two variants of each call site, the second whenever the first key >= 2**31 comes up,
    mid-run and at different steps on different ranks. As int32 every key has one type."""
    return rng._s32(key)


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Launch(NamedTuple):
    """One kernel launch as fixed by its shapes, strides, dtypes and codecs, without its tensors
    and its key: ``grids`` (each grid with its first row: grids have at most
    :data:`_MAX_GRID_ROWS` rows), the integer arguments before the key (``head``) and after the
    first row (``tail``), the keyword arguments (constexprs and options, shared: never changed)
    and ``keying``, how a call's ``seed`` becomes the key (:func:`launch_keying`). A collective's
    plan keeps the launches of its first call (:func:`recording`) and gives each later call's
    tensors and key to :func:`quantize_again` / :func:`dequantize_again`: the same arguments,
    nothing derived again. ``handles``: per grid, the compiled kernel its first
    replay found (:class:`~qsdp.codecs.kernel_handles.Handle`; ``False``: none serves, ``None``:
    not replayed yet), which later replays use instead of Triton's dispatch."""

    grids: tuple
    head: tuple
    tail: tuple
    kwargs: dict
    keying: int
    handles: list


# The Launch lists of the active recordings (recording()): every launch computed is appended.
_RECORDINGS: list[list[Launch]] = []


@contextlib.contextmanager
def recording():
    """Within it, the :class:`Launch` of every ``quantize_into`` / ``dequantize_into`` call that
    launches is appended to the yielded list (``quantize_again`` / ``dequantize_again`` derive none)."""
    launches: list[Launch] = []
    _RECORDINGS.append(launches)
    try:
        yield launches
    finally:
        _RECORDINGS.remove(launches)


def _recorded(launch: Launch) -> None:
    for launches in _RECORDINGS:
        launches.append(launch)


# Launch.keying: how a call's seed becomes the kernel's key (an int, tested at every launch).
_NO_KEY = -1  # no random stream: 0
_PREFIX_KEY = 0  # the seed is the slices' prefix: its int32 bits
# (otherwise the rounding's stream: the int32 bits of rng.seed_key(seed, stream), _rounding_key)


def launch_keying(rounding: str | None) -> int:
    """:attr:`Launch.keying` of a launch rounding with ``rounding`` (``None``: a slices' prefix)."""
    if rounding is None:
        return _PREFIX_KEY
    if rounding == "nearest":
        return _NO_KEY
    return rng.STREAM_GROUP if rounding == "shift" else rng.STREAM_ELEMENT


def _grids(blocks: int, rows: int, count: int) -> tuple:
    """The grids of ``rows`` rows (at most :data:`_MAX_GRID_ROWS` each) with their first rows."""
    return tuple(((blocks, min(_MAX_GRID_ROWS, rows - row0), count), row0) for row0 in range(0, rows, _MAX_GRID_ROWS))


def quantize_into(
    x: torch.Tensor,
    dst: Packed,
    *,
    length: int = 0,
    padded: int = 0,
    ncodes: int = 0,
    bits: int = 0,
    group_size: int = 0,
    symmetric: bool = True,
    rounding: str = "nearest",
    seed: int | None = None,
    base: torch.Tensor | None = None,
    hadamard_block: int = 0,
    order: torch.Tensor | None = None,
    slices: Slices | None = None,
    tail: int = 0,
) -> Launch | None:
    """Quantize the rows of ``x`` (``[R, length]``; minus ``base`` if given) padded to ``padded``
    elements by repeating the last, Hadamard-transformed first if ``hadamard_block``, into
    ``dst``; the first ``ncodes`` codes of each row are stored. ``order`` (int64 ``[R']`` on the
    device): output row ``r`` quantizes row ``order[r]`` of ``x``. ``slices``: the row is cut into
    rounding slices quantized as rows of their own into ``dst`` (:meth:`Packed.sliced`), with
    their own seeds (``seed`` is ignored), in the same launch; ``ncodes`` must be ``padded``.
    ``tail`` rows: ``x`` is one vector (``[1, length]``) cut into ``tail`` rows of ``padded``
    elements, the last ones (short of or past its end) padded by repeating its last element.

    Returns the :class:`Launch` (``None`` where nothing was launched), which a plan may keep and
    give a later call's tensors (:func:`quantize_again`)."""
    x = _rows_2d(x)
    if base is not None:
        base = _rows_2d(base)
    launch = _quantize_launch(x, dst, length, padded, ncodes, bits, group_size, symmetric, rounding, base,
                              hadamard_block, order, slices, tail)
    if launch is None:
        return None
    if slices is not None:
        seed = slices.prefix
    if _RECORDINGS:
        _recorded(launch)
    _ran_triton()
    key = rng.launch_key(seed, launch.keying)
    head, tail_args, kwargs = launch.head, launch.tail, launch.kwargs
    for k, (grid, row0) in enumerate(launch.grids):
        args = (x, x if base is None else base, dst[0], dst[1], dst[2], x if order is None else order,
                *head, key, row0, *tail_args)
        _steady(_quantize_kernel, launch.handles, k, grid, args, kwargs, True)
    return launch


def quantize_again(launch: Launch, x: torch.Tensor, dst: torch.Tensor, key: int,
                   base: torch.Tensor | None = None, order: torch.Tensor | None = None) -> None:
    """:func:`quantize_into` of a plan's kept ``launch`` (one grid: :func:`~qsdp.comm.wire.one_launch`)
    with a later call's tensors: ``x`` (and ``base``, ``order``) as there, ``dst`` one uint8
    buffer holding the codes, scales and zero points, ``key`` the seed as the launch takes it
    (``rng.launch_key(seed, launch.keying)``: a plan's :meth:`~qsdp.codecs.rng.CallSeeds` with
    ``keys`` looks it up). Its arguments are positional and nothing is derived: what a steady
    call launches with (``quantize_into``'s keyword binding alone costs about a third of a
    launch's host time)."""
    _ran_triton()
    (grid, row0), = launch.grids
    args = (x, x if base is None else base, dst, dst, dst, x if order is None else order, *launch.head,
            key, row0, *launch.tail)
    _steady(_quantize_kernel, launch.handles, 0, grid, args, launch.kwargs, False)


def _quantize_launch(x, dst, length, padded, ncodes, bits, group_size, symmetric, rounding, base, hadamard_block,
                     order, slices, tail) -> Launch | None:
    """:func:`quantize_into`'s launch (see there), ``None`` where it launches nothing."""
    rows = tail or (x.shape[0] if order is None else order.shape[0])
    groups = padded // group_size
    if rows == 0 or groups == 0:
        return None
    if slices is None:
        keying, count, sg, sw, first = launch_keying(rounding), 1, groups, 0, 0
    else:
        keying, count = _PREFIX_KEY, slices.count
        sg, sw, first = slices.groups, slices.nbytes, slices.first
    y = base if base is not None else x
    gpp, kwargs = _quantize_template(group_size, sg, hadamard_block, bits, symmetric, rounding, x.dtype,
                                     None if base is None else base.dtype, order is not None, slices is not None,
                                     bool(tail))
    head = (length, groups, ncodes, dst.ncb, padded if tail else x.stride(0), y.stride(0),
            dst.code_rs, dst.code_off, dst.scale_rs, dst.scale_off, dst.zero_off)
    grids = _grids(-(-sg // gpp), rows, count)
    return Launch(grids, head, (sg, sw, first), kwargs, keying, [None] * len(grids))


@functools.lru_cache(maxsize=4096)
def _quantize_template(group_size: int, sg: int, hb: int, bits: int, symmetric: bool, rounding: str,
                       x_dtype: torch.dtype, base_dtype: torch.dtype | None, permuted: bool,
                       sliced: bool, tail: bool) -> tuple[int, dict]:
    """``_quantize_kernel``'s groups a program and keyword arguments (its constexprs and launch
    options), fixed by the codec, the tile and the dtypes: built once, a launch only adds its
    tensors and integers (the caller must not change the dict)."""
    bg, gpp, nch = _checked_tile(group_size, sg, hb)
    kwargs = dict(
        GS=group_size, BG=bg, GPP=gpp, NCH=nch, BITS=bits, SYMMETRIC=symmetric,
        ROUNDING=_ROUNDING[rounding], HB=hb, HB_LOG=hb.bit_length() - 1 if hb else 0,
        X_KIND=_kind_of(x_dtype), Y_KIND=_kind_of(base_dtype) if base_dtype is not None else -1, PERMUTED=permuted,
        **(dict(TAIL=True) if tail else {}),
        num_warps=_warps(gpp * bg), **(dict(SLICED=True, KEY_TERM=_key_term(rounding)) if sliced else {}), **_LAUNCH,
    )
    return gpp, kwargs


def dequantize_into(
    src: Packed,
    *,
    groups: int = 0,
    bits: int = 0,
    group_size: int = 0,
    symmetric: bool = True,
    sources: int = 1,
    outputs: int = 1,
    row_o: int = 1,
    row_j: int = 0,
    out: torch.Tensor | None = None,
    length: int = 0,
    add: bool = False,
    inverse_block: int = 0,
    requantize: tuple[Packed, int, bool, str, int | None] | None = None,
    slices: Slices | None = None,
    divisor: int = 1,
    flag: torch.Tensor | None = None,
) -> Launch | None:
    """Output row ``o < outputs`` = sum over ``j < sources`` (left to right) of the dequantized
    packed rows ``o * row_o + j * row_j`` of ``src``. Either stored into ``out`` (``[outputs,
    >= length]``, unit column stride, fp32/bf16/fp16; first ``length`` columns; inverse Hadamard
    first if ``inverse_block``; added to ``out`` if ``add``) or, with ``requantize = (dst, bits,
    symmetric, rounding, seed)``, quantized again with the same groups into ``dst``.
    ``slices``: the rows are rounding slices side by side (:meth:`Packed.sliced`, also ``dst``),
    each decoded (and requantized, with its own seed) as rows of their own in the same launch;
    ``out``'s columns hold the slices one after another. ``divisor``, ``flag``: :func:`_watch_args`.

    Returns the :class:`Launch` (``None`` where nothing was launched), which a plan may keep and
    give a later call's tensors (:func:`dequantize_again`)."""
    launch = _dequantize_launch(src, groups, bits, group_size, symmetric, sources, outputs, row_o, row_j, out,
                                length, add, inverse_block, requantize, slices, divisor, flag)
    if launch is None:
        return None
    if _RECORDINGS:
        _recorded(launch)
    _ran_triton()
    if requantize is None:
        q, out_arg, key = src, out, 0
    else:
        seed = requantize[4] if slices is None else slices.prefix
        q, out_arg, key = requantize[0], src[1], rng.launch_key(seed, launch.keying)
    head, tail_args, kwargs = launch.head, launch.tail, launch.kwargs
    for k, (grid, row0) in enumerate(launch.grids):
        args = (src[0], src[1], src[2], out_arg, q[0], q[1], q[2], *head, key, row0, *tail_args,
                src[0] if flag is None else flag)
        _steady(_dequantize_kernel, launch.handles, k, grid, args, kwargs, True)
    return launch


def dequantize_again(launch: Launch, src: torch.Tensor, out: torch.Tensor | None = None,
                     dst: torch.Tensor | None = None, key: int = 0,
                     flag: torch.Tensor | None = None) -> None:
    """:func:`dequantize_into` of a plan's kept ``launch`` (one grid) with a later call's tensors
    (:func:`quantize_again`): ``src`` one uint8 buffer of packed rows; ``out``, or ``dst`` (one
    buffer) and the requantization's ``key`` (as :func:`quantize_again`'s); ``flag`` as there."""
    _ran_triton()
    (grid, row0), = launch.grids
    if dst is None:
        q, out_arg = src, out
    else:
        q, out_arg = dst, src
    args = (src, src, src, out_arg, q, q, q, *launch.head, key, row0, *launch.tail,
            src if flag is None else flag)
    _steady(_dequantize_kernel, launch.handles, 0, grid, args, launch.kwargs, False)


def _dequantize_launch(src, groups, bits, group_size, symmetric, sources, outputs, row_o, row_j, out, length, add,
                       inverse_block, requantize, slices, divisor, flag) -> Launch | None:
    """:func:`dequantize_into`'s launch (see there), ``None`` where it launches nothing."""
    if outputs == 0 or groups == 0:
        return None
    if requantize is None:
        if out.stride(-1) != 1:
            raise ValueError("out must have a unit column stride")
        q, qshape, keying, q_ncb = src, None, _NO_KEY, 0
        out_rs, out_dtype = out.stride(0) if out.dim() > 1 else 0, out.dtype
    else:
        q, qbits, qsym, qround, _ = requantize
        qshape = (qbits, qsym, qround)
        keying = launch_keying(None if slices is not None else qround)
        q_ncb, out_rs, out_dtype = q.ncb, 0, None
    count, sg, sw, q_sw, first = _dequantize_slices(slices, groups)
    gpp, nch, kwargs = _dequantize_template(sources, group_size, sg, inverse_block, bits, symmetric, qshape,
                                            out_dtype, add, slices is not None, divisor, flag is not None)
    head = (row_o, row_j, groups, src.ncb, src.code_rs, src.code_off, src.scale_rs, src.scale_off,
            src.zero_off, length, out_rs, q_ncb, q.code_rs, q.code_off, q.scale_rs, q.scale_off, q.zero_off)
    grids = _grids(-(-sg // gpp) * nch, outputs, count)
    return Launch(grids, head, (sg, sw, q_sw, first), kwargs, keying, [None] * len(grids))


# Where the requantized rows' code, scale and zero-point offsets sit in a dequantize launch's head.
_Q_CODE_OFF, _Q_SCALE_OFF, _Q_ZERO_OFF = 13, 15, 16


def requantized_further(launch: Launch, nbytes: int) -> Launch:
    """``launch`` (a requantizing ``dequantize_into``'s, rows of :meth:`Packed.rows`) writing
    its requantized rows ``nbytes`` bytes further into their buffer (a multiple of 4: the scales
    and zero points move by ``nbytes // 4`` fp32 words)."""
    head = list(launch.head)
    head[_Q_CODE_OFF] += nbytes
    head[_Q_SCALE_OFF] += nbytes // 4
    head[_Q_ZERO_OFF] += nbytes // 4
    return launch._replace(head=tuple(head), handles=[None] * len(launch.grids))


@functools.lru_cache(maxsize=4096)
def _dequantize_template(sources: int, group_size: int, sg: int, hb: int, bits: int, symmetric: bool,
                         requantize: tuple | None, out_dtype: torch.dtype | None, add: bool, sliced: bool,
                         divisor: int, watch: bool) -> tuple[int, int, dict]:
    """``_dequantize_kernel``'s groups a program, chunks a group and keyword arguments (its
    constexprs and launch options), fixed by the codecs, the tile, the output's dtype and the
    watch (``requantize``: ``(bits, symmetric, rounding)`` of the requantized rows): built once,
    a launch only adds its tensors and integers (the caller must not change the dict)."""
    bg, gpp, nch = _checked_tile(group_size, sg, hb)
    if requantize is None:
        qkw, mode, kind = dict(Q_BITS=8, Q_SYMMETRIC=True, Q_ROUNDING=0), 0, _kind_of(out_dtype)
    else:
        if nch != 1 or hb:
            raise ValueError("requantization needs groups of at most MAX_TILE and no inverse Hadamard")
        qbits, qsym, qround = requantize
        qkw, mode, kind = dict(Q_BITS=qbits, Q_SYMMETRIC=qsym, Q_ROUNDING=_ROUNDING[qround]), 1, 0
    slice_kw = dict(SLICED=True, KEY_TERM=_key_term(requantize[2]) if requantize else 0) if sliced else {}
    kwargs = dict(
        K=sources, GS=group_size, BG=bg, GPP=gpp, NCH=nch, BITS=bits, SYMMETRIC=symmetric, HB=hb,
        HB_LOG=hb.bit_length() - 1 if hb else 0, MODE=mode, OUT_KIND=kind, ADD=add, **qkw,
        **_watch_args(divisor, watch), num_warps=_warps(gpp * bg), **slice_kw, **_LAUNCH,
    )
    return gpp, nch, kwargs


def _watch_args(divisor: int, watch: bool) -> dict:
    """``_dequantize_kernel``'s DIV and WATCH, only where asked (its plain variants stay the ones
    compiled before): stored into ``out``, ``divisor`` > 1 divides the value in fp32 before the
    cast (``torch.div(value, divisor, out=out)``); with ``watch``, the ``flag`` argument (int32
    ``[1]`` on the device) is set to 1 where a stored value is NaN or infinite."""
    return {**({"DIV": divisor} if divisor != 1 else {}), **({"WATCH": True} if watch else {})}


def _dequantize_slices(slices: Slices | None, groups: int):
    """``_dequantize_kernel``'s slice arguments: (slice count, groups a slice, packed bytes a
    slice, requantized bytes a slice, first slice)."""
    if slices is None:
        return 1, groups, 0, 0, 0
    return slices.count, slices.groups, slices.nbytes, slices.q_nbytes, slices.first


# ----------------------------------------------------------------------------- codec entry points


def quantize_flat(
    flat: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, rounding: str, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`qsdp.codecs.quantize` of a flat, non-empty tensor: (codes, scales, zeros)."""
    n = flat.numel()
    groups = -(-n // group_size)
    dev = flat.device
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=dev)
    scales = torch.empty(groups, dtype=torch.float32, device=dev)
    zeros = None if symmetric else torch.empty(groups, dtype=torch.float32, device=dev)
    quantize_into(
        flat.view(1, n), Packed.flat(codes, scales, zeros, n, bits), length=n, padded=groups * group_size,
        ncodes=n, bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding, seed=seed,
    )
    return codes, scales, zeros


def dequantize_flat(q, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`qsdp.codecs.dequantize` of a non-empty :class:`~qsdp.codecs.QTensor`, flat."""
    n = q.numel
    out = torch.empty(n, dtype=dtype, device=q.codes.device)
    dequantize_into(
        Packed.flat(q.codes, q.scales.contiguous(), None if q.zeros is None else q.zeros.contiguous(), n, q.bits),
        groups=q.n_groups, bits=q.bits, group_size=q.group_size, symmetric=q.symmetric,
        out=out.view(1, n), length=n,
    )
    return out
