"""Counter-based random numbers: a pure function of (seed, stream, index).

Stochastic rounding must give the same bits on every rank, in the forward and the backward
gather of one step, and in a GPU kernel that reproduces the CPU reference exactly. A global
generator that advances cannot promise any of that; a hash of the element's index can.

The hash of index ``i`` under the 32-bit key ``k = seed_key(seed, stream)`` is
``mix(mix(i * 0x9E3779B1 + k) ^ k)`` with ``mix`` the lowbias32 finalizer, all in wrapping
uint32 arithmetic; its top 24 bits are the uniform number. Keys and seeds are folded on the host
with plain Python integers. The tensors do the same arithmetic in int32 (products wrap modulo
2**32 exactly as uint32 ones; a logical right shift is an arithmetic one plus a mask), in place,
over chunks small enough to stay in the CPU's cache: each of the hash's ~20 passes then costs
about a tenth of a nanosecond per element, and no full-size integer tensor is ever allocated.
On CPU the passes run in numpy's uint32 over the tensors' memory (:func:`_uniform_bits_cpu`):
the same bits, fewer passes, and each far cheaper to start than a torch operation.
"""

from __future__ import annotations

import array
import functools
import math
import threading
from typing import Callable

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
# Streams of the generator, so that per-element and per-group draws never coincide (used by the
# torch reference and the Triton kernels alike).
STREAM_ELEMENT = 1
STREAM_GROUP = 2
# Elements per CPU chunk: three int32/fp32 buffers of 256 KiB stay in L2.
_CHUNK = 1 << 16
_INV24 = 1.0 / (1 << 24)


def _s32(v: int) -> int:
    """The int32 whose bits are ``v mod 2**32`` (what an int32 tensor op must be given)."""
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix32_int(x: int) -> int:
    """lowbias32 on a Python int in [0, 2**32)."""
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def hash32(index: int, key: int) -> int:
    """The 32-bit hash of one index under one key, in Python integers (the specification that
    the tensor code and the kernels reproduce)."""
    x = _mix32_int((index * _GOLDEN + key) & _MASK32)
    return _mix32_int(x ^ key)


def seed_key(seed: int, stream: int = 0) -> int:
    """Fold an arbitrary Python int seed and a stream number into one 32-bit key."""
    x = (seed & _MASK32) ^ ((stream * 0x9E3779B9) & _MASK32)
    # The high word goes in after a round of mixing: xor-ing both words together first made
    # seeds ``a + (b << 32)`` and ``b + (a << 32)`` (e.g. 1 and 2**32) collide. Unchanged for
    # seeds in [0, 2**32). Both rounds are _mix32_int written out: every collective call derives
    # its seeds, and a Python call costs more than a round.
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    x ^= (x >> 16) ^ ((seed >> 32) & _MASK32)
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from a tuple of integers (base seed, collective id, step, rank, ...): each
    part is folded in through the hash, so nearby tuples give unrelated seeds."""
    key = 0x2545F491
    for p in parts:
        key = fold_seed(key, p)
    return key


def fold_seed(seed: int, part: int) -> int:
    """``derive_seed(*parts, part)`` from ``seed = derive_seed(*parts)``: one more part folded in
    (the Triton kernels fold a rounding slice's index in the same way, ``_slice_key``)."""
    return seed_key(int(part) ^ seed, stream=len(str(part)))


def fold_seeds(seed: int, *parts: int) -> int:
    """``fold_seed`` of each of ``parts`` in turn (``derive_seed(*before, *parts)`` from ``seed =
    derive_seed(*before)``), in one call: every collective call derives its rounding seeds this
    way. :func:`seed_key` written out in the loop (the same arithmetic)."""
    m1, m2, mask = _M1, _M2, _MASK32
    for part in parts:
        part = int(part)
        s = part ^ seed
        x = (s & mask) ^ ((len(str(part)) * 0x9E3779B9) & mask)
        x ^= x >> 16
        x = (x * m1) & mask
        x ^= x >> 15
        x = (x * m2) & mask
        x ^= (x >> 16) ^ ((s >> 32) & mask)
        x ^= x >> 16
        x = (x * m1) & mask
        x ^= x >> 15
        x = (x * m2) & mask
        seed = x ^ (x >> 16)
    return seed


# 10**1 .. 10**19: a part's decimal digits (fold_seed's stream) are 1 + how many it reaches.
_POW10 = np.array([10**k for k in range(1, 20)], dtype=np.uint64)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """:func:`_mix32_int` elementwise on uint64 arrays of values below 2**32 (the products stay
    below 2**64)."""
    mask = np.uint64(_MASK32)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(_M1)) & mask
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(_M2)) & mask
    return x ^ (x >> np.uint64(16))


def _fold_seed_np(seed: np.ndarray, part: np.ndarray, digits: int = 0) -> np.ndarray:
    """:func:`fold_seed` elementwise: ``seed`` and ``part`` uint64 arrays (or scalars);
    ``digits``: ``part``'s decimal digits where it is one number (0: counted here)."""
    mask = np.uint64(_MASK32)
    s = seed ^ part
    if digits:
        stream = np.uint64(digits)
    else:
        stream = np.searchsorted(_POW10, part, side="right").astype(np.uint64) + np.uint64(1)
    x = (s & mask) ^ ((stream * np.uint64(0x9E3779B9)) & mask)
    x = _mix32_np(x) ^ ((s >> np.uint64(32)) & mask)
    return _mix32_np(x)


def launch_key(seed: int, key: int | None) -> int:
    """What a kernel launch takes for ``seed`` (a 32-bit seed), by ``key``: ``None``, the seed
    itself; ``-1``, 0 (no random stream); ``0``, the seed's int32 bits; a stream ``s > 0``,
    the int32 bits of ``seed_key(seed, s)``."""
    if key is None:
        return seed
    if key < 0:
        return 0
    return _s32(seed if key == 0 else seed_key(seed, key))


def _launch_key_np(seeds: np.ndarray, key: int) -> np.ndarray:
    """:func:`launch_key` elementwise on uint64 ``seeds`` below 2**32, as int64."""
    if key < 0:
        return np.zeros(seeds.shape, dtype=np.int64)
    if key > 0:  # seed_key(seed, key) = fold_seed's arithmetic on part 0 with stream key
        seeds = _fold_seed_np(seeds, np.uint64(0), key)
    return seeds.astype(np.uint32).view(np.int32).astype(np.int64)


class CallSeeds:
    """The rounding seeds of a comm's calls: ``table(call)`` is, for each of ``tails``,
    ``fold_seeds(prefix, call, *tail)``, the same integers.

    A collective call derives its seeds by folding its call number and a few constants into the
    comm's prefix: about 0.7 us of Python arithmetic a fold, four to eight folds a call. The
    table derives them for :attr:`BATCH` consecutive calls at once in numpy (about 0.2 us a
    call), so a steady call only looks its seeds up; a call outside the batch (the first, a
    resumed run's, a gap) starts a new one there. The batch is kept as 8-byte integers (16 KiB
    for two tails), not as Python objects.

    ``keys``: for each tail, what a kernel launch takes for its seed (:func:`launch_key`; ``None``
    for the seed itself): a steady call's launches then fold nothing on the host either.
    """

    BATCH = 1024

    def __init__(self, prefix: int, tails: tuple[tuple[int, ...], ...],
                 keys: tuple[int | None, ...] | None = None) -> None:
        if not 0 <= prefix <= _MASK32:
            raise ValueError(f"prefix={prefix} must be a 32-bit seed (derive_seed's)")
        if any(not 0 <= p < 1 << 63 for tail in tails for p in tail):
            raise ValueError(f"the parts of {tails} must be integers in [0, 2**63)")
        if keys is not None and len(keys) != len(tails):
            raise ValueError(f"keys={keys} must give one entry for each of the {len(tails)} tails")
        self.prefix = prefix
        self.tails = tuple(tuple(int(p) for p in tail) for tail in tails)
        self.keys = keys
        self._arity = len(self.tails)
        self._first = self._size = 0
        self._columns: list = []  # one array("Q") a tail
        self._a = self._b = None  # the first two columns, read without a loop

    def __call__(self, call: int) -> tuple[int, ...]:
        i = call - self._first
        if 0 <= i < self._size:
            if self._arity == 2:
                return (self._a[i], self._b[i])
            if self._arity == 1:
                return (self._a[i],)
            return tuple(c[i] for c in self._columns)
        return self._fill(call)

    def _fill(self, call: int) -> tuple[int, ...]:
        keys = self.keys or (None,) * self._arity
        if not 0 <= call < (1 << 63) - self.BATCH:
            return tuple(launch_key(fold_seeds(self.prefix, call, *tail), k) for tail, k in zip(self.tails, keys))
        calls = np.arange(call, call + self.BATCH, dtype=np.uint64)
        head = _fold_seed_np(np.full_like(calls, self.prefix), calls)
        columns = []
        for tail, k in zip(self.tails, keys):
            x = head
            for part in tail:
                x = _fold_seed_np(x, np.uint64(part), len(str(part)))
            if k is None:
                column = array.array("Q")
            else:
                column = array.array("q")
                x = _launch_key_np(x, k)
            column.frombytes(x.tobytes())
            columns.append(column)
        self._columns = columns
        self._a = columns[0] if columns else None
        self._b = columns[1] if len(columns) > 1 else None
        self._first, self._size = call, self.BATCH
        return self(call)


def fresh_seed() -> int:
    """A seed drawn from torch's global generator, for callers that did not pass one."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _xorshift_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """``x ^= x >> shift`` with a logical shift of the int32 bits (``tmp``: scratch of x's size)."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_and_((1 << (32 - shift)) - 1)
    x.bitwise_xor_(tmp)


def _mix32_head_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """lowbias32 in place, all but its closing ``x ^= x >> 16``."""
    _xorshift_(x, 16, tmp)
    x.mul_(_s32(_M1))
    _xorshift_(x, 15, tmp)
    x.mul_(_s32(_M2))


def _mix32_tail_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """lowbias32 in place, all but its opening ``x ^= x >> 16``."""
    x.mul_(_s32(_M1))
    _xorshift_(x, 15, tmp)
    x.mul_(_s32(_M2))
    _xorshift_(x, 16, tmp)


def _golden_ramp(n: int, device: torch.device) -> torch.Tensor:
    """``i * 0x9E3779B1 mod 2**32`` for ``i < n``, as int32 (the per-index term of the hash)."""
    return torch.arange(n, dtype=torch.int32, device=device).mul_(_s32(_GOLDEN))


@functools.lru_cache(maxsize=1)
def _cpu_ramp() -> torch.Tensor:
    """:func:`_golden_ramp` of :data:`_CHUNK` elements on CPU, computed in numpy: it is built at
    import (:data:`_CPU`), and a torch operator of that size would run an OpenMP parallel region,
    after which no child forked from the importing process (a fork server, a forked data loader)
    can run one of its own (GNU OpenMP deadlocks there)."""
    ramp = np.arange(_CHUNK, dtype=np.uint32) * np.uint32(_GOLDEN)  # wraps modulo 2**32
    return torch.from_numpy(ramp.view(np.int32))


def _uniform_bits_int32(
    start: int | torch.Tensor, key: int | torch.Tensor, ramp: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor
) -> torch.Tensor:
    """The hash's top 24 bits for indices ``start + j`` (``j < x.numel()``; ``ramp`` the matching
    slice of :func:`_golden_ramp`), written into the int32 buffer ``x`` (returned) as values in
    [0, 2**24); ``tmp`` is scratch of the same size. In torch's int32, on any device (on CPU,
    :func:`_uniform_bits_cpu` gives the same bits faster).

    Per-row keys (:func:`_RowKeys`): ``start`` and ``key`` are then the int32 ``[rows, 1]``
    terms ``_s32(start * _GOLDEN + key)`` and ``_s32(key ^ (key >> 16))`` of each row, and
    ``x`` is ``[rows, ramp.numel()]``: the same wrapping int32 arithmetic, broadcast."""
    if isinstance(key, torch.Tensor):
        torch.add(ramp, start, out=x)
        mixed_key = key
    else:
        torch.add(ramp, _s32(start * _GOLDEN + key), out=x)
        mixed_key = _s32(key ^ (key >> 16))
    # mix(mix(a) ^ key) with the first mix's closing xorshift and the second's opening one
    # cancelled: y ^ (y >> 16) ^ key, shifted and xor-ed again, is y ^ key ^ (key >> 16)
    # (a 32-bit word shifted right by 32 is 0). Same bits, six passes fewer.
    _mix32_head_(x, tmp)
    x.bitwise_xor_(mixed_key)
    _mix32_tail_(x, tmp)
    x.bitwise_right_shift_(8)
    return x.bitwise_and_(0xFFFFFF)


class _CpuScratch(threading.local):
    """A CPU thread's buffers for the hash, made once per thread (the importing thread's at
    import, another's at its first draw; a draw then allocates and converts nothing): an int32
    buffer of :data:`_CHUNK` elements, as a tensor and as numpy's uint32 view of the same
    memory, numpy scratch, and the ramp's numpy view."""

    def __init__(self) -> None:
        self.x = torch.empty(_CHUNK, dtype=torch.int32)
        self.u = self.x.numpy().view(np.uint32)
        self.t = np.empty(_CHUNK, dtype=np.uint32)
        self.ramp = _cpu_ramp().numpy().view(np.uint32)


_CPU = _CpuScratch()


def _uniform_bits_cpu(start: int | np.ndarray, key: int | np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`_uniform_bits_int32` on CPU, for ``shape`` (``[n]`` or ``[rows, n]``, at most
    :data:`_CHUNK` elements), in numpy's uint32 over the thread's buffer, returned as an int32
    view of it (valid until the thread's next draw): the same wrapping arithmetic, where the
    shifts are logical (no mask after each, as int32 needs) and an operation on 2048 elements
    costs about 2 us, against 1.3 to 10 us for torch's int32 ones. On a small shard the hash's
    passes were most of a quantization's host time. Per-row keys: ``start`` and ``key``
    are the uint32 ``[rows, 1]`` terms of :class:`_RowKeys`."""
    size = math.prod(shape)
    u, t, r = _CPU.u[:size].reshape(shape), _CPU.t[:size].reshape(shape), _CPU.ramp[: shape[-1]]
    if isinstance(key, np.ndarray):
        first, mixed = start, key
    else:
        first, mixed = np.uint32((start * _GOLDEN + key) & _MASK32), np.uint32(key ^ (key >> 16))
    np.add(r, first, out=u)
    for shift, factor in ((16, _M1), (15, _M2)):  # mix, less its closing xorshift (as _mix32_head_)
        np.bitwise_xor(u, np.right_shift(u, shift, out=t), out=u)
        np.multiply(u, np.uint32(factor), out=u)
    np.bitwise_xor(u, mixed, out=u)
    for factor, shift in ((_M1, 15), (_M2, 16)):  # mix, less its opening xorshift (as _mix32_tail_)
        np.multiply(u, np.uint32(factor), out=u)
        np.bitwise_xor(u, np.right_shift(u, shift, out=t), out=u)
    np.right_shift(u, 8, out=u)  # logical: below 2**24, so the int32 view reads the same value
    return _CPU.x[:size].view(shape)


class _RowKeys:
    """The keys of ``seeds`` (one per row) on ``stream``, folded on the host as :func:`seed_key`
    folds one; :meth:`terms` gives a block of rows' terms for :func:`_uniform_bits_int32` (int32
    tensors on the device) or, on CPU, :func:`_uniform_bits_cpu` (numpy uint32 arrays: a tensor
    would have to be read as one at every draw)."""

    def __init__(self, seeds, stream: int, device: torch.device) -> None:
        self.keys = [seed_key(int(s), stream) for s in seeds]
        self.device = device
        # Each row's second term does not depend on the index: made once for all the rows.
        self.mixed = self._terms([k ^ (k >> 16) for k in self.keys])

    def terms(self, r0: int, r1: int, start: int) -> tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]:
        first = self._terms([start * _GOLDEN + k for k in self.keys[r0:r1]])
        return first[:, None], self.mixed[r0:r1, None]

    def _terms(self, values: list[int]) -> torch.Tensor | np.ndarray:
        if self.device.type == "cpu":
            return np.array([v & _MASK32 for v in values], dtype=np.uint32)
        t = torch.tensor([_s32(v) for v in values], dtype=torch.int32)
        # From pinned memory, without blocking: a copy from pageable memory would wait for the
        # device's queue (a host sync).
        return t.pin_memory().to(self.device, non_blocking=True)


def _row_tiles(rows: int, n: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    """``(first row, end row, first column, end column)`` tiles of a ``[rows, n]`` tensor: whole
    rows, as many as fit in one cache-sized chunk, or a row cut into chunks where one is larger
    (CPU); the whole tensor at once on other devices."""
    if device.type != "cpu":
        return [(0, rows, 0, n)]
    if n <= _CHUNK:
        step = max(1, _CHUNK // max(n, 1))
        return [(r0, min(rows, r0 + step), 0, n) for r0 in range(0, rows, step)]
    return [(r, r + 1, c0, min(n, c0 + _CHUNK)) for r in range(rows) for c0 in range(0, n, _CHUNK)]


def _tile_draws(tiles, n: int, device: torch.device) -> Callable[..., torch.Tensor]:
    """``draw(first, mixed, shape)``: :func:`_uniform_bits_int32` of a tile of ``shape`` and
    its rows' terms, in the thread's buffer on CPU, elsewhere in buffers made here for the
    largest tile (with the ramp of the widest)."""
    if device.type == "cpu":
        return _uniform_bits_cpu
    r0, r1, c0, c1 = tiles[0]
    ramp = _golden_ramp(n, device)
    xb = torch.empty((r1 - r0) * (c1 - c0), dtype=torch.int32, device=device)
    tb = torch.empty_like(xb)

    def draw(first: torch.Tensor, mixed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        x, tmp = (b[: shape[0] * shape[1]].view(shape) for b in (xb, tb))
        return _uniform_bits_int32(first, mixed, ramp[: shape[1]], x, tmp)

    return draw


def add_uniform_rows_(v: torch.Tensor, seeds, *, offset: int = 0, stream: int = 0) -> torch.Tensor:
    """``v[r] += uniform(seeds[r], v.shape[1], offset=offset, stream=stream)`` for every row of
    the contiguous float32 ``[rows, n]`` tensor ``v``, in place, returned: the same bits as one
    :func:`add_uniform_` per row, with the rows of a cache-sized chunk in one pass of each step."""
    if v.dtype != torch.float32 or not v.is_contiguous() or v.dim() != 2:
        raise ValueError(f"add_uniform_rows_ needs a contiguous float32 [rows, n] tensor, got {v.dtype} "
                         f"{list(v.shape)}")
    rows, n = v.shape
    if len(seeds) != rows:
        raise ValueError(f"add_uniform_rows_: {len(seeds)} seeds for {rows} rows")
    if v.numel() == 0:
        return v
    keys = _RowKeys(seeds, stream, v.device)
    tiles = _row_tiles(rows, n, v.device)
    draw = _tile_draws(tiles, n, v.device)
    for r0, r1, c0, c1 in tiles:
        first, mixed = keys.terms(r0, r1, offset + c0)
        # As add_uniform_: the integers (below 2**24) become fp32 exactly inside the addition.
        v[r0:r1, c0:c1].add_(draw(first, mixed, (r1 - r0, c1 - c0)), alpha=_INV24)
    return v


def uniform_rows(seeds, n: int, *, offset: int = 0, stream: int = 0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(seeds), n]``: row ``r`` is ``uniform(seeds[r], n, offset=offset, stream=stream)``."""
    return add_uniform_rows_(torch.zeros(len(seeds), n, dtype=torch.float32, device=device), seeds,
                             offset=offset, stream=stream)


def _chunks(n: int, device: torch.device) -> list[tuple[int, int, Callable[[int, int], torch.Tensor]]]:
    """``(begin, end, draw)`` over ``[0, n)``, ``draw(start, key)`` the hash's bits of that
    span's indices from ``start`` on: cache-sized chunks in the thread's buffer on CPU, the whole
    range at once elsewhere, in buffers made here (a GPU gains nothing from chunking)."""
    if device.type == "cpu":
        spans = [(b, min(n, b + _CHUNK)) for b in range(0, n, _CHUNK)]
        return [(b, e, functools.partial(_uniform_bits_cpu, shape=(e - b,))) for b, e in spans]
    if n == 0:
        return []
    ramp = _golden_ramp(n, device)
    x = torch.empty(n, dtype=torch.int32, device=device)
    tmp = torch.empty_like(x)
    return [(0, n, lambda start, key: _uniform_bits_int32(start, key, ramp, x, tmp))]


def add_uniform_(v: torch.Tensor, seed: int, *, offset: int = 0, stream: int = 0) -> torch.Tensor:
    """``v += uniform(seed, v.numel(), offset=offset, stream=stream)`` in place, for a contiguous
    float32 ``v`` of any shape, without a full-size temporary; returns ``v``."""
    if v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(f"add_uniform_ needs a contiguous float32 tensor, got {v.dtype}")
    key = seed_key(seed, stream)
    flat = v.view(-1)
    for b, e, draw in _chunks(flat.numel(), v.device):
        # The integers (below 2**24) become fp32 exactly inside the addition, and the product
        # with 2**-24 is exact, so this is ``v + u`` rounded once, FMA or not: no fp32 copy of
        # the numbers is made (one operator fewer per chunk).
        flat[b:e].add_(draw(offset + b, key), alpha=_INV24)
    return v


def uniform(
    seed: int, n: int, *, offset: int = 0, stream: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``n`` floats in [0, 1) (float32, multiples of 2**-24), element ``i`` a function of
    ``(seed, stream, offset + i)`` alone: the top 24 bits of :func:`hash32` times 2**-24."""
    key = seed_key(seed, stream)
    out = torch.empty(n, dtype=torch.float32, device=device)
    for b, e, draw in _chunks(n, out.device):
        out[b:e].copy_(draw(offset + b, key)).mul_(_INV24)
    return out
