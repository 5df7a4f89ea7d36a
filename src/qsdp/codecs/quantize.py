"""Group-wise uniform quantization (reference implementation in plain torch).

Two schemes:

* symmetric (absmax): ``scale = absmax / qmax`` with ``qmax = 2**(bits-1) - 1``; levels
  ``-qmax..qmax`` (for 4 bits -7..7, the code for -8 is never used, as in SDP4Bit). Codes are
  stored offset-binary, ``code = level + 2**(bits-1)``.
* asymmetric (min-max, CGX / QSDP style): ``unit = (max - min) / (2**bits - 1)``, levels
  ``0..2**bits-1``, one zero point (the group minimum) per group.

Three roundings of ``v = x / scale`` (in units of the grid):

* ``nearest``: ``round(v)``, error <= scale / 2, biased.
* ``stochastic``: ``floor(v + u_i)`` with ``u_i`` uniform per element: unbiased, error < scale.
* ``shift``: QSDP's random shift, ``floor(v + u_g)`` with one uniform offset per group shared by
  all its elements (equivalently, nearest rounding on a grid shifted by a random amount):
  unbiased over the seed, error < scale, one random number per group instead of per element.

The random numbers are a pure function of ``(seed, index)`` (see :mod:`qsdp.codecs.rng`).

Non-finite groups: a group holding a NaN or an infinity (among the values quantized: the input,
or the difference ``x - base`` of the weight-difference path, or a row sum of the middle step)
has one encoding, on every device and path: its scale and (min-max) zero point are the fp32 bit
pattern :data:`NON_FINITE_BITS` (``0x7FC00000``, the positive quiet NaN) and every code of the
group is 0. Every element of such a group decodes to NaN, so a non-finite value can never pass for
a finite one, and the quantize check and the step's non-finite watch see it. Both the reference
and the fused kernels write it with an integer select on the scale's bits, never as the result of
float arithmetic on a NaN (GPU arithmetic returns its own canonical NaN, ``0x7FFFFFFF``, and drops
the operand's payload, where a CPU keeps it). A finite group whose range overflows fp32 is not
non-finite: its scale is infinite, as the arithmetic gives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import rng
from .dispatch import use_triton
from .pack import SUPPORTED_BITS, pack_codes, packed_nbytes, unpack_codes
from .usage import record_run

ROUNDINGS = ("nearest", "stochastic", "shift")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPE = torch.float32
# The fp32 bits of a non-finite group's scale and zero point (see the module docstring).
NON_FINITE_BITS = 0x7FC00000


def check_scheme(*, bits: int, group_size: int, rounding: str) -> None:
    """Raise ``ValueError`` naming the first unsupported value."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, SUPPORTED_BITS))}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; allowed: {', '.join(ROUNDINGS)}")


def wire_nbytes(numel: int, *, bits: int, group_size: int, symmetric: bool) -> int:
    """Exact bytes a :class:`QTensor` of ``numel`` elements occupies: packed codes plus one fp32
    scale per group (and one fp32 zero point per group for min-max)."""
    n_groups = math.ceil(numel / group_size)
    per_group = SCALE_DTYPE.itemsize * (1 if symmetric else 2)
    return packed_nbytes(numel, bits) + n_groups * per_group


@dataclass
class QTensor:
    """A quantized tensor as it travels.

    Attributes:
        codes: packed codes, uint8, 1-D, ``ceil(numel * bits / 8)`` bytes.
        scales: float32 ``[n_groups]``; the grid step of each group.
        zeros: float32 ``[n_groups]`` group minima for min-max, ``None`` for symmetric.
        shape, dtype: of the tensor that was quantized.
        bits, group_size, symmetric: the scheme.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    symmetric: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_groups(self) -> int:
        return math.ceil(self.numel / self.group_size)

    @property
    def nbytes_on_wire(self) -> int:
        """Bytes of the buffers that travel: codes, scales and zero points."""
        n = self.codes.numel() + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            n += self.zeros.numel() * self.zeros.element_size()
        return n

    def to_bytes(self) -> torch.Tensor:
        """One flat uint8 buffer: scales, then zero points, then codes (scales first keeps them
        4-byte aligned when the buffer starts aligned)."""
        parts = [self.scales.contiguous().view(torch.uint8)]
        if self.zeros is not None:
            parts.append(self.zeros.contiguous().view(torch.uint8))
        parts.append(self.codes)
        return torch.cat(parts)

    @classmethod
    def from_bytes(
        cls,
        buf: torch.Tensor,
        *,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        bits: int,
        group_size: int,
        symmetric: bool,
    ) -> "QTensor":
        """Inverse of :meth:`to_bytes`; the metadata is what both ends know from the config."""
        shape = torch.Size(shape)
        numel = math.prod(shape)
        expected = wire_nbytes(numel, bits=bits, group_size=group_size, symmetric=symmetric)
        buf = buf.reshape(-1)
        if buf.dtype != torch.uint8 or buf.numel() != expected:
            raise ValueError(
                f"expected a uint8 buffer of {expected} bytes for {numel} elements, "
                f"got {buf.numel()} elements of {buf.dtype}"
            )
        ng = math.ceil(numel / group_size)
        sb = ng * SCALE_DTYPE.itemsize
        scales = buf[:sb].clone().view(SCALE_DTYPE)
        off = sb
        zeros = None
        if not symmetric:
            zeros = buf[off : off + sb].clone().view(SCALE_DTYPE)
            off += sb
        return cls(buf[off:], scales, zeros, shape, dtype, bits, group_size, symmetric)


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN or infinite elements of ``x``."""
    return int((~torch.isfinite(x)).sum().item())


# Elements a CPU chunk of the reference holds: its fp32 working copy (512 KiB) stays in a 1 MiB
# L2, so each of the chunk's passes costs a fraction of a nanosecond per element, while the
# chunk is still large enough that the per-operation overhead of torch does not dominate.
_CHUNK = 1 << 17


def _grouped(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[n_groups, group_size]`` view of ``flat``; a partial last group is filled with copies of
    its last element, which changes neither its min, max nor absmax."""
    n = flat.numel()
    pad = (-n) % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, group_size)


def _group_chunks(n: int, group_size: int, device: torch.device) -> list[tuple[int, int]]:
    """``(first group, end group)`` of consecutive whole groups covering ``n`` elements: about
    :data:`_CHUNK` elements each on CPU, everything at once on other devices."""
    groups = -(-n // group_size)
    step = max(1, _CHUNK // group_size) if device.type == "cpu" else max(groups, 1)
    return [(g0, min(groups, g0 + step)) for g0 in range(0, groups, step)]


def _round_(
    v: torch.Tensor, rounding: str, seed: int, first_group: int, shifts: torch.Tensor | None
) -> torch.Tensor:
    """Round the contiguous fp32 grid coordinates ``v`` (``[groups, group_size]``, the groups
    from ``first_group`` on) in place; ``shifts``: these groups' random shifts (``shift`` only)."""
    if rounding == "nearest":
        return v.round_()
    if rounding == "stochastic":
        rng.add_uniform_(v, seed, offset=first_group * v.shape[1], stream=rng.STREAM_ELEMENT)
    else:  # shift: one offset per group
        v.add_(shifts.unsqueeze(1))
    return v.floor_()


def _all_finite(scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
    ok = torch.isfinite(scales).all()
    if zeros is not None:
        ok &= torch.isfinite(zeros).all()
    return bool(ok)


def quantize(
    x: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    rounding: str,
    seed: int | None = None,
    check_finite: bool = True,
) -> QTensor:
    """Quantize ``x`` (any shape; fp32, bf16 or fp16) group-wise over its flattened elements.

    Args:
        bits: 2, 4 or 8.
        group_size: contiguous elements of ``x.reshape(-1)`` sharing one scale.
        symmetric: absmax (``True``) or min-max with a zero point (``False``).
        rounding: ``"nearest"``, ``"stochastic"`` or ``"shift"``.
        seed: the random bits are a pure function of ``(seed, element or group index)``; ``None``
            draws a seed from torch's global generator.
        check_finite: raise ``ValueError`` on NaN/Inf input. With ``False`` the caller checks the
            returned scales instead (a non-finite input gives a non-finite scale), which costs
            nothing extra on the training path.
    """
    check_scheme(bits=bits, group_size=group_size, rounding=rounding)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={x.dtype} is not supported; allowed: float32, bfloat16, float16")
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        empty = torch.empty(0, dtype=SCALE_DTYPE, device=x.device)
        return QTensor(
            torch.empty(0, dtype=torch.uint8, device=x.device), empty,
            None if symmetric else empty.clone(), x.shape, x.dtype, bits, group_size, symmetric,
        )
    if rounding != "nearest" and seed is None:
        seed = rng.fresh_seed()
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding, seed=seed)
    codes = None
    if use_triton(flat):
        from . import triton_kernels

        if triton_kernels.supports(bits=bits, group_size=group_size):
            codes, scales, zeros = triton_kernels.quantize_flat(flat, **kw)
    if codes is None:
        codes, scales, zeros = quantize_reference(flat, **kw)
    # A non-finite input always gives a non-finite scale or zero point, so the (small) scales
    # are checked rather than every element; the elements are counted only for the message
    # (a finite input whose range overflows fp32 also gives an infinite scale, and passes).
    if check_finite and not _all_finite(scales, zeros):
        bad = count_nonfinite(flat)
        if bad:
            raise ValueError(f"quantize: input has {bad} non-finite values (NaN or Inf) out of {n}")
    return QTensor(codes, scales, zeros, x.shape, x.dtype, bits, group_size, symmetric)


def _scales_(
    g: torch.Tensor, bits: int, symmetric: bool, scales: torch.Tensor, zeros: torch.Tensor | None
) -> None:
    """The fp32 ``[groups, group_size]`` chunk ``g``'s scales (and zero points), written into
    ``scales`` (``zeros``); a non-finite group's are :data:`NON_FINITE_BITS` (amin/amax/absmax
    propagate NaN, so a group's statistics are finite exactly when its values are).

    Exactness notes (the fused kernels reproduce this bit for bit, on every device): the divisor
    is a tensor on the data's device, because CUDA turns a division by a Python scalar into a
    multiplication by its reciprocal; ``+ 0.0`` makes a zero minimum or maximum +0.0, since which
    signed zero amin/amax return depends on the reduction order."""
    # Finiteness by comparisons (false for NaN): ``isfinite`` is several operators per call on
    # CPU, and on small chunks torch's per-operator cost is most of the codec's time.
    if symmetric:
        amax = g.abs().amax(dim=1)
        torch.div(amax, _constant(2 ** (bits - 1) - 1, amax.device), out=scales)
        bad = ~(amax < math.inf)  # an absmax is >= 0 or NaN
    else:
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        torch.add(lo, 0.0, out=zeros)
        torch.div(hi + 0.0 - zeros, _constant(2**bits - 1, zeros.device), out=scales)
        bad = ~((lo > -math.inf) & (hi < math.inf))  # min <= max: both finite exactly then
        _non_finite_(zeros, bad)
    _non_finite_(scales, bad)


def _divisors(scales: torch.Tensor) -> torch.Tensor:
    """What each group's values are divided by, ``[groups, 1]``: its scale, 1 for a zero scale (a
    group of zeros). A non-finite group's scale is NaN (:data:`NON_FINITE_BITS`) and stays the
    divisor: every value of the group becomes NaN, which rounding and clamping keep and
    :func:`_store_codes` turns into code 0."""
    return torch.where(scales <= 0, _constant(1.0, scales.device), scales).unsqueeze(1)


# From this many elements on, CPU codes go from fp32 to uint8 through int16: torch's CPU
# conversion fp32 -> uint8 is not vectorized (0.6 ns an element on one core of a 2-core EPYC,
# 40 us for 64K elements), fp32 -> int16 -> uint8 is (9 us); below it, the second operator's
# fixed cost is more than it saves.
_VIA_INT16 = 1 << 14


def _store_codes(out: torch.Tensor, v: torch.Tensor) -> None:
    """Write the integer-valued fp32 grid coordinates ``v`` (already clamped to the code range)
    into the uint8 codes ``out`` of the same shape; NaN, every value of a non-finite group,
    becomes code 0. ``v`` is overwritten."""
    v.nan_to_num_(0.0)  # one vectorized pass: a fill under a per-group mask costs 6 times as much
    out.copy_(v.to(torch.int16) if v.device.type == "cpu" and v.numel() >= _VIA_INT16 else v)


@functools.lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-dim tensor of ``value`` on ``device``, made once (read-only: every use is an
    operand, never written)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _non_finite_(t: torch.Tensor, bad: torch.Tensor) -> None:
    """Write :data:`NON_FINITE_BITS` into the fp32 ``t`` where ``bad``: an integer select, so the
    bits do not depend on the NaN payload that the float arithmetic gave on this device."""
    t.view(torch.int32).masked_fill_(bad, NON_FINITE_BITS)


def quantize_reference(
    flat: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, rounding: str, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The torch reference of :func:`quantize` (the oracle of the fused kernels) on a flat,
    non-empty, finite-or-not tensor, without checks or dispatch: ``(codes, scales, zeros)``.

    On CPU it runs over cache-sized chunks of whole groups: no full-size float temporary, only
    the unpacked uint8 codes (one byte per element) before packing."""
    record_run("torch")
    if rounding != "nearest" and seed is None:
        seed = rng.fresh_seed()
    n, dev = flat.numel(), flat.device
    groups = -(-n // group_size)
    scales = torch.empty(groups, dtype=SCALE_DTYPE, device=dev)
    zeros = None if symmetric else torch.empty(groups, dtype=SCALE_DTYPE, device=dev)
    codes = torch.empty(groups, group_size, dtype=torch.uint8, device=dev)
    qmax = 2 ** (bits - 1) - 1
    # Drawn once for all groups: per chunk, the generator's fixed cost would dominate.
    shifts = rng.uniform(seed, groups, stream=rng.STREAM_GROUP, device=dev) if rounding == "shift" else None
    for g0, g1 in _group_chunks(n, group_size, dev):
        sh = None if shifts is None else shifts[g0:g1]
        g = _grouped(flat[g0 * group_size : g1 * group_size].float(), group_size)
        s = scales[g0:g1]
        _scales_(g, bits, symmetric, s, None if symmetric else zeros[g0:g1])
        safe = _divisors(s)
        if symmetric:
            v = _round_(torch.div(g, safe), rounding, seed, g0, sh).clamp_(-qmax, qmax).add_(qmax + 1)
        else:
            v = torch.div(g - zeros[g0:g1].unsqueeze(1), safe)
            v = _round_(v, rounding, seed, g0, sh).clamp_(0, 2**bits - 1)
        _store_codes(codes[g0:g1], v)
    return pack_codes(codes.view(-1)[:n], bits), scales, zeros


def quantize_rows_reference(
    x: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, rounding: str, seeds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row of ``x`` (``[rows, n]``, float, ``n`` whole groups packing into whole bytes)
    quantized as :func:`quantize_reference` quantizes it alone with the seed ``seeds[r]``, in
    one pass of each step for all the rows of a cache-sized chunk: ``(codes [rows, packed
    bytes], scales [rows, n / group_size], zeros)``. The rounding slices of one exchange are
    such rows; one call per slice would pay torch's per-operation cost once per slice."""
    rows, n = x.shape
    if n % group_size or (n * bits) % 8:
        raise ValueError(f"quantize_rows_reference: rows of {n} elements are not whole groups of {group_size} "
                         f"packing into whole bytes at {bits} bits")
    if len(seeds) != rows:
        raise ValueError(f"quantize_rows_reference: {len(seeds)} seeds for {rows} rows")
    record_run("torch")
    dev, per_row = x.device, n // group_size
    scales = torch.empty(rows, per_row, dtype=SCALE_DTYPE, device=dev)
    zeros = None if symmetric else torch.empty(rows, per_row, dtype=SCALE_DTYPE, device=dev)
    codes = torch.empty(rows, n, dtype=torch.uint8, device=dev)
    qmax = 2 ** (bits - 1) - 1
    shifts = None
    if rounding == "shift":
        shifts = rng.uniform_rows(seeds, per_row, stream=rng.STREAM_GROUP, device=dev)
    # Tiles of whole groups: rows of whole rows, or one row's run of groups (see rng._row_tiles).
    for r0, r1, g0, g1 in _group_tiles(rows, per_row, group_size, dev):
        g = x[r0:r1, g0 * group_size : g1 * group_size].float().reshape(-1, group_size)
        s = scales[r0:r1, g0:g1].reshape(-1)
        z = None if symmetric else zeros[r0:r1, g0:g1].reshape(-1)
        _scales_(g, bits, symmetric, s, z)
        safe = _divisors(s)
        v = torch.div(g, safe) if symmetric else torch.div(g - z.unsqueeze(1), safe)
        if rounding == "nearest":
            v.round_()
        elif rounding == "stochastic":
            rng.add_uniform_rows_(v.view(r1 - r0, -1), seeds[r0:r1], offset=g0 * group_size,
                                  stream=rng.STREAM_ELEMENT)
            v.floor_()
        else:
            v.add_(shifts[r0:r1, g0:g1].reshape(-1, 1)).floor_()
        v = v.clamp_(-qmax, qmax).add_(qmax + 1) if symmetric else v.clamp_(0, 2**bits - 1)
        _store_codes(codes[r0:r1, g0 * group_size : g1 * group_size], v.view(r1 - r0, -1))
    return pack_codes(codes.view(-1), bits).view(rows, -1), scales, zeros


def _group_tiles(rows: int, per_row: int, group_size: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    """``(first row, end row, first group, end group)`` tiles of about :data:`_CHUNK` elements on
    CPU (as many whole rows as fit, or one row's groups in chunks where a row is larger), the
    whole tensor at once on other devices."""
    if device.type != "cpu":
        return [(0, rows, 0, per_row)]
    step = max(1, _CHUNK // group_size)  # groups per tile
    if per_row <= step:
        r_step = max(1, step // max(per_row, 1))
        return [(r0, min(rows, r0 + r_step), 0, per_row) for r0 in range(0, rows, r_step)]
    return [(r, r + 1, g0, min(per_row, g0 + step)) for r in range(rows) for g0 in range(0, per_row, step)]


def dequantize(q: QTensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ``q`` as a tensor of ``q.shape`` and ``dtype`` (default float32)."""
    n = q.numel
    if n == 0:
        return torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    if use_triton(q.codes):
        from . import triton_kernels

        if triton_kernels.supports(bits=q.bits, group_size=q.group_size) and dtype in FLOAT_DTYPES:
            return triton_kernels.dequantize_flat(q, dtype=dtype).view(q.shape)
    return dequantize_reference(q).to(dtype).view(q.shape)


def dequantize_reference(q: QTensor) -> torch.Tensor:
    """The torch reference of :func:`dequantize` (non-empty ``q``): flat float32 values, computed
    in place over cache-sized chunks of whole groups (the output is the only float tensor)."""
    record_run("torch")
    n, gs = q.numel, q.group_size
    codes = unpack_codes(q.codes, q.bits, n)
    vals = torch.empty(q.n_groups, gs, dtype=torch.float32, device=codes.device)
    flat = vals.view(-1)
    if n < flat.numel():
        flat[n:].zero_()  # the padding of a partial last group: never returned, but finite
    for g0, g1 in _group_chunks(n, gs, codes.device):
        flat[g0 * gs : min(g1 * gs, n)].copy_(codes[g0 * gs : g1 * gs])
        g, s = vals[g0:g1], q.scales[g0:g1].unsqueeze(1)
        if q.symmetric:
            g.sub_(2 ** (q.bits - 1)).mul_(s)
        else:
            g.mul_(s).add_(q.zeros[g0:g1].unsqueeze(1))
    return flat[:n]
