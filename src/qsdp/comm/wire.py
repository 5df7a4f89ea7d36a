"""The wire format of a collective: rows of a matrix, each row one destination's (or source's)
data, encoded into equal-sized uint8 rows that an all-gather or all-to-all moves.

A row of ``L`` elements is padded to ``L_pad``, a whole number of quantization groups (and of
Hadamard blocks), by repeating its last element (which changes no group's min, max or absmax).
Its bytes are ``[fp32 scales][fp32 zero points (min-max only)][packed codes]``, padded to a
multiple of 4 bytes so that every row's scales stay aligned. All of this padding travels and is
metered. An unquantized codec sends the raw fp32 (or parameter-dtype) bytes of the row. A group
holding NaN or an infinity (after the difference, the Hadamard transform or the middle step's sum)
sends the fixed non-finite encoding of :mod:`qsdp.codecs.quantize`: scale and zero point
``0x7FC00000``, every code 0.

Every step has a torch reference (the oracle) and, for CUDA tensors, a fused Triton kernel giving
the same bytes (:mod:`qsdp.codecs.triton_kernels`, chosen by :func:`qsdp.codecs.dispatch.use_triton`).
Sums of received rows go left to right (:func:`sum_rows`): an order that a kernel can reproduce,
unlike ``torch.sum``'s, which depends on the device, the sizes and the CPU's vector width.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from ..codecs import dequantize, hadamard, inverse_hadamard, quantize
from ..codecs.dispatch import use_triton
from ..codecs.quantize import QTensor, _group_chunks, quantize_rows_reference
from ..codecs.rng import CallSeeds, fold_seed
from .row_layout import RowLayout


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)


def _check_out(out: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``out``, after checking that it can hold ``rows`` encoded rows of ``width`` bytes."""
    if out.dtype != torch.uint8 or tuple(out.shape) != (rows, width):
        raise ValueError(f"out must be uint8 [{rows}, {width}], got {out.dtype} {list(out.shape)}")
    return out


def _deliver(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Encoded ``rows`` where the caller asked for them: themselves (no ``out``, or ``out`` is
    them), else copied into ``out`` (checked)."""
    return rows if out is None or rows is out else _check_out(out, *rows.shape).copy_(rows)


def sum_rows(x: torch.Tensor) -> torch.Tensor:
    """``x[0] + x[1] + ... + x[k-1]`` (over the first dimension), added left to right."""
    acc = x[0].clone()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


def _row_chunks(rows: int, width: int, device: torch.device) -> list[tuple[int, int]]:
    """``(first row, end row)`` of consecutive rows, a cache-sized chunk each on CPU (at least one
    row), every row at once on other devices: quantize's chunks, with a row as the group. A
    received buffer holds one row per peer; decoding them all at once would be a temporary the
    size of the whole group."""
    return _group_chunks(rows * width, max(1, width), device)


@dataclass(frozen=True)
class SliceRun:
    """Rounding slices ``first .. first + count - 1`` of a padded row of ``end`` elements that
    travel together: slice ``k`` covers ``[k * per, min((k + 1) * per, end))`` (``per`` whole
    codec units) and is encoded as a row of its own with the seed ``fold_seed(prefix, k)``; its
    encoded rows sit side by side in one buffer, in slice order (:meth:`columns`)."""

    first: int
    count: int
    per: int
    end: int

    def __post_init__(self) -> None:
        # Read on every step of every call, and a dict key of its plan: plain attributes and a
        # hash, computed once.
        #: The run's first element and its end.
        object.__setattr__(self, "start", self.first * self.per)
        object.__setattr__(self, "stop", min((self.first + self.count) * self.per, self.end))
        object.__setattr__(self, "_hash", hash((self.first, self.count, self.per, self.end)))

    def __hash__(self) -> int:
        return self._hash

    def bounds(self) -> list[tuple[int, int]]:
        return [(k * self.per, min((k + 1) * self.per, self.end)) for k in range(self.first, self.first + self.count)]

    def columns(self, codec: "RowCodec") -> list[tuple[int, int]]:
        """Each slice's byte columns ``[c0, c1)`` in the buffer of the run's encoded rows."""
        out, c = [], 0
        for a, b in self.bounds():
            w = codec.row_nbytes(b - a)
            out.append((c, c + w))
            c += w
        return out

    def nbytes(self, codec: "RowCodec") -> int:
        return self.columns(codec)[-1][1]


@dataclass(frozen=True)
class RowCodec:
    """Encodes ``[R, L]`` float rows into ``[R, row_nbytes(L)]`` uint8 rows and back.

    ``bits=None`` is the exact codec: rows travel as raw bytes of ``raw_dtype``.
    ``hadamard_block`` > 0 transforms each row (blockwise) before quantizing; :meth:`decode`
    leaves rows in the Hadamard domain (``inverse`` is the caller's last step), so that a
    dequantize-sum-requantize hop stays in that domain.
    """

    bits: int | None = None
    group_size: int = 128
    symmetric: bool = True
    rounding: str = "stochastic"
    hadamard_block: int = 0
    raw_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        # Read on every step of every call: plain attributes, computed once (not fields).
        exact = self.bits is None
        #: Whether rows travel as raw bytes.
        object.__setattr__(self, "exact", exact)
        #: Elements of the smallest row span no group or Hadamard block crosses: rows are padded
        #: to whole units.
        object.__setattr__(self, "unit", 1 if exact else (
            math.lcm(self.group_size, self.hadamard_block) if self.hadamard_block else self.group_size))
        # A key of the caches a call consults (_slices_fuse_of): hashed once.
        object.__setattr__(self, "_hash", hash((self.bits, self.group_size, self.symmetric, self.rounding,
                                                self.hadamard_block, self.raw_dtype)))

    def __hash__(self) -> int:
        return self._hash

    def padded_len(self, length: int) -> int:
        if self.exact or length == 0:
            return length
        return -(-length // self.unit) * self.unit

    def row_nbytes(self, length: int) -> int:
        if self.exact:
            return length * self.raw_dtype.itemsize
        lp = self.padded_len(length)
        groups = lp // self.group_size
        n = groups * 4 * (1 if self.symmetric else 2) + lp * self.bits // 8
        return -(-n // 4) * 4

    def encode(self, x: torch.Tensor, *, seed: int, transformed: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``[R, L]`` float. Returns uint8 ``[R, row_nbytes(L)]``. ``transformed`` says the
        rows are already in the Hadamard domain (padded to whole blocks). ``out``: where to write
        those rows (uint8 ``[R, row_nbytes(L)]``, rows may be strided: columns of a wider send
        buffer), returned; the same bytes as without it."""
        rows, length = x.shape
        if self.exact:
            raw = x.to(self.raw_dtype).contiguous().view(torch.uint8).view(rows, -1)
            return _deliver(raw, out)
        if self._fused(x) and x.dtype in _OUT_DTYPES:
            return self._encode_fused(x, None, seed=seed, transformed=transformed, out=out)
        lp = self.padded_len(length)
        xp = _pad_cols(x.float(), lp)
        if self.hadamard_block and not transformed:
            xp = hadamard(xp, block=self.hadamard_block)
        q = quantize(
            xp, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
            rounding=self.rounding, seed=seed, check_finite=False,
        )
        # quantize's scales and codes are separate tensors: they are copied into the rows anyway,
        # so a given ``out`` costs nothing extra.
        out = self._alloc(rows, lp, x.device, out)
        col = 0
        for part in (q.scales, q.zeros, q.codes):
            if part is not None:
                part = part.view(rows, -1).view(torch.uint8)
                out[:, col : col + part.shape[1]] = part
                col += part.shape[1]
        return out

    def encode_cut(self, x: torch.Tensor, rows: int, length: int, *, seed: int) -> torch.Tensor:
        """``encode`` of ``x`` (float ``[n]``, ``n <= rows * length``; ``length`` a whole number
        of units) cut into ``rows`` rows of ``length``, padded by repeating its last element. On
        the fused path the kernel cuts and pads (no padded copy is made)."""
        n = x.numel()
        if n == rows * length and x.dtype == torch.float32:
            return self.encode(x.view(rows, length), seed=seed)  # whole rows already: encoded where they are
        hb = self.hadamard_block
        if (self._fused(x) and x.dtype in _OUT_DTYPES and x.is_contiguous()
                and (not hb or _tk().fuses_hadamard(self.group_size, hb))):
            packed = self._alloc(rows, length, x.device)
            _tk().quantize_into(
                x.view(1, n), self._packed(packed, length), length=n, padded=length, ncodes=length, bits=self.bits,
                group_size=self.group_size, symmetric=self.symmetric, rounding=self.rounding, seed=seed,
                hadamard_block=hb, tail=rows,
            )
            return packed
        cut = torch.empty(rows * length, dtype=torch.float32, device=x.device)
        cut[:n] = x
        # Pad by repeating the last element, which widens no quantization group's range.
        cut[n:] = x[-1]
        return self.encode(cut.view(rows, length), seed=seed)

    def decode(self, buf: torch.Tensor, length: int, *, keep_padding: bool = False) -> torch.Tensor:
        """``buf``: uint8 ``[R, row_nbytes(length)]``. Returns float32 ``[R, length]`` (or
        ``[R, padded_len(length)]`` with ``keep_padding``), still in the Hadamard domain."""
        rows = buf.shape[0]
        if self.exact:
            return buf.contiguous().view(self.raw_dtype).view(rows, length).float()
        lp = self.padded_len(length)
        if self._fused(buf):
            out = torch.empty(rows, lp if keep_padding else length, dtype=torch.float32, device=buf.device)
            return self._decode_fused(buf, lp, out, add=False)
        groups = lp // self.group_size
        sb = groups * 4
        scales = buf[:, :sb].contiguous().view(torch.float32).reshape(-1)
        off = sb
        zeros = None
        if not self.symmetric:
            zeros = buf[:, off : off + sb].contiguous().view(torch.float32).reshape(-1)
            off += sb
        cb = lp * self.bits // 8
        codes = buf[:, off : off + cb].reshape(-1)
        q = QTensor(codes, scales, zeros, torch.Size([rows * lp]), torch.float32,
                    self.bits, self.group_size, self.symmetric)
        out = dequantize(q).view(rows, lp)
        return out if keep_padding else out[:, :length]

    def decode_finished(self, buf: torch.Tensor, length: int) -> torch.Tensor:
        """``finish(decode(buf, length, keep_padding=True), length)``: float32 ``[R, length]``
        out of the Hadamard domain, in one launch on CUDA where the kernel fuses the inverse."""
        if self._fused(buf) and (not self.hadamard_block or _tk().fuses_hadamard(self.group_size, self.hadamard_block)):
            lp = self.padded_len(length)
            out = torch.empty(buf.shape[0], length, dtype=torch.float32, device=buf.device)
            _tk().dequantize_into(
                self._packed(buf, lp), groups=lp // self.group_size, bits=self.bits, group_size=self.group_size,
                symmetric=self.symmetric, sources=1, outputs=buf.shape[0], row_o=1, row_j=0, out=out,
                length=length, inverse_block=self.hadamard_block,
            )
            return out
        return self.finish(self.decode(buf, length, keep_padding=True), length)

    def finish(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Leave the Hadamard domain (rows padded to whole blocks) and drop the padding."""
        if self.hadamard_block and not self.exact:
            x = inverse_hadamard(x, block=self.hadamard_block)
        return x[..., :length]

    # ------------------------------------------------------------------ fused steps
    # Each method below is defined by its reference expression (the torch path); on CUDA the
    # same result comes from one Triton kernel.

    def encode_difference(self, x: torch.Tensor, base: torch.Tensor, *, seed: int) -> torch.Tensor:
        """``encode(x.float() - base.float())`` (the weight difference), in one pass on CUDA."""
        if self._fused(x) and base.shape == x.shape and x.dtype in _OUT_DTYPES and base.dtype in _OUT_DTYPES:
            return self._encode_fused(x, base, seed=seed, transformed=False)
        # copy=True: the difference is taken in place and must never alias the caller's x.
        return self.encode(x.to(torch.float32, copy=True).sub_(base), seed=seed)

    def decode_into(self, buf: torch.Tensor, length: int, out: torch.Tensor, *, add: bool = False,
                    columns: torch.Tensor | None = None) -> torch.Tensor:
        """``out[:] = decode(buf, length)`` cast to ``out.dtype``, or with ``add``,
        ``out[:] = (out.float() + decode(buf, length)).to(out.dtype)`` (the replica update).
        ``out``: ``[R, length]`` of float32, bfloat16 or float16; with ``columns`` (int64
        ``[C]``, a :class:`~qsdp.comm.row_layout.RowLayout`'s positions), ``[R, C]`` taking
        those columns of the decoded rows."""
        if columns is None and self._fused(buf) and out.dtype in _OUT_DTYPES and out.stride(-1) == 1:
            self._decode_fused(buf, self.padded_len(length), out, add=add)
            return out
        for r0, r1 in _row_chunks(buf.shape[0], length, buf.device):
            values, dest = self.decode(buf[r0:r1], length), out[r0:r1]
            if columns is not None:
                values = values.index_select(1, columns)
            if add:  # dest + values in fp32; in place unless values may be a view of buf (exact codec)
                values = dest.float() + values if self.exact else values.add_(dest)
            dest.copy_(values)
        return out

    def decode_sum(self, buf: torch.Tensor, length: int, *, finish: bool = False) -> torch.Tensor:
        """``sum_rows(decode(buf, length, keep_padding=True))``: float32 ``[padded_len(length)]``;
        with ``finish``, passed through :meth:`finish` (inverse Hadamard, padding dropped)."""
        if self.exact:
            total = sum_rows(self.decode(buf, length, keep_padding=True))
            return self.finish(total, length) if finish else total
        total, finished = self._sum_sources(buf, length, buf.shape[0], finish=finish)
        total = total[0]
        return self.finish(total, length) if finish and not finished else total

    def decode_sum_finished_into(self, buf: torch.Tensor, length: int, out: torch.Tensor, *, divisor: int = 1,
                                 flag: torch.Tensor | None = None) -> bool:
        """Where one kernel can: ``torch.div(decode_sum(buf, length, finish=True), divisor,
        out=out)`` (``out``: ``[length]``, contiguous, fp32/bf16/fp16), ``flag`` (int32 ``[1]``)
        set to 1 if a stored value is not finite; whether it did (``False``: nothing was done)."""
        if not (self._fused(buf) and out.dtype in _OUT_DTYPES and out.is_contiguous()):
            return False
        hb = self.hadamard_block
        if hb and not _tk().fuses_hadamard(self.group_size, hb):
            return False
        lp = self.padded_len(length)
        _tk().dequantize_into(
            self._packed(buf, lp), groups=lp // self.group_size, bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, sources=buf.shape[0], outputs=1, row_o=1, row_j=1, out=out.view(1, -1),
            length=length, inverse_block=hb, divisor=divisor, flag=flag,
        )
        return True

    def decode_sum_encode(
        self, buf: torch.Tensor, length: int, *, sources: int, codec: "RowCodec", seed: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The two-level middle step: ``buf`` holds ``sources x D`` rows (source-major); row ``n``
        of the result is ``codec.encode`` (still in the Hadamard domain) of the sum over the
        sources of their dequantized row ``n``:
        ``codec.encode(sum_rows(decode(buf, length, keep_padding=True).view(sources, D, -1)),
        transformed=True)``, written into ``out`` where given (as :meth:`encode`). One kernel on
        CUDA when both codecs quantize with the same groups."""
        lp = self.padded_len(length)
        if (
            self._fused(buf) and codec._fused(buf) and codec.group_size == self.group_size
            and codec.padded_len(lp) == lp and self.group_size <= _tk().MAX_TILE
        ):
            tk = _tk()
            dests = buf.shape[0] // sources
            packed = codec._kernel_rows(dests, lp, buf.device, out)
            tk.dequantize_into(
                self._packed(buf, lp), groups=lp // self.group_size, bits=self.bits, group_size=self.group_size,
                symmetric=self.symmetric, sources=sources, outputs=dests, row_o=1, row_j=dests,
                requantize=(codec._packed(packed, lp), codec.bits, codec.symmetric, codec.rounding, seed),
            )
            return _deliver(packed, out)
        partial, _ = self._sum_sources(buf, length, sources, finish=False)
        return codec.encode(partial, seed=seed, transformed=True, out=out)

    # ------------------------------------------------------------------ rounding slices
    # A run of rounding slices (SliceRun) in one launch per step on the fused path, each slice
    # with its own seed and the bytes of one call per slice; the torch reference takes the equal
    # slices of a run as the rows of one call per step (_batches), with the same bytes.

    def fuses_slices(self, run: SliceRun, t: torch.Tensor, codec: "RowCodec | None" = None) -> bool:
        """Whether the slices of ``run`` of tensors like ``t`` take one launch a step."""
        return not self.exact and self._slices_fuse(run, t, codec)

    def _slices_fuse(self, run: SliceRun, t: torch.Tensor, codec: "RowCodec | None" = None) -> bool:
        # keyed by the tile limit too: tests lower it
        return self._fused(t) and _slices_fuse_of(self, run, codec, _tk().MAX_TILE)

    def _slices_fuse_uncached(self, run: SliceRun, codec: "RowCodec | None" = None) -> bool:
        """Whether the kernels can take ``run`` in one launch on a device that takes them: every
        slice whole groups (and Hadamard blocks) with no 4-byte padding to zero, for this codec
        and ``codec``."""
        if self.exact or not _supported(self.bits, self.group_size) or self.group_size > _tk().MAX_TILE:
            return False
        if self.hadamard_block and not _tk().fuses_hadamard(self.group_size, self.hadamard_block):
            return False
        for c in (self, codec or self):
            if c.group_size != self.group_size or c.exact or not _supported(c.bits, c.group_size):
                return False
            for a, b in run.bounds()[-2:]:
                lp = b - a
                if c.padded_len(lp) != lp or c.row_nbytes(lp) != (lp // c.group_size) * 4 * (1 if c.symmetric else 2) \
                        + lp * c.bits // 8:
                    return False
        return True

    def _slices(self, run: SliceRun, prefix: int, codec: "RowCodec | None" = None):
        return _tk().Slices(count=run.count, groups=run.per // self.group_size, first=run.first, prefix=prefix,
                            nbytes=self.row_nbytes(run.per), q_nbytes=(codec or self).row_nbytes(run.per))

    def encode_slices(self, x: torch.Tensor, run: SliceRun, *, prefix: int, out: torch.Tensor,
                      order: torch.Tensor, layout: RowLayout | None = None) -> torch.Tensor:
        """The slices of ``run`` of the rows ``order`` (int64 on ``x``'s device) of ``x``
        (``[R, L]``; columns of ``layout``'s rows where given, else the row padded past ``L`` by
        repeating its last column), each ``encode``-d with the seed ``fold_seed(prefix, k)``
        into its columns of ``out`` (uint8 ``[len(order), run.nbytes(self)]``, contiguous),
        returned."""
        length = x.shape[1]
        if layout is None:
            layout = RowLayout.of(None, length, 1)
        if layout.identity and self._slices_fuse(run, x) and x.dtype in _OUT_DTYPES:
            tk = _tk()
            tk.quantize_into(
                x[:, run.start:], tk.Packed.sliced(out), length=length - run.start, padded=run.stop - run.start,
                ncodes=run.stop - run.start, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                rounding=self.rounding, seed=None, hadamard_block=self.hadamard_block, order=order,
                slices=self._slices(run, prefix),
            )
            return out
        bounds, cols = run.bounds(), run.columns(self)
        for i0, i1 in self._batches(run, len(order), x):
            (a, _), (_, b), (c0, _), (_, c1) = bounds[i0], bounds[i1 - 1], cols[i0], cols[i1 - 1]
            values = _pad_cols(layout.columns(x, order, a, b).float(), b - a)
            if i1 - i0 == 1:
                self.encode(values, seed=fold_seed(prefix, run.first + i0), out=out[:, c0:c1])
            else:
                self._encode_batch(values.view(len(order), i1 - i0, run.per).transpose(0, 1),
                                   _seeds(prefix, run.first + i0, run.first + i1), out[:, c0:c1])
        return out

    def decode_sum_encode_slices(self, buf: torch.Tensor, run: SliceRun, *, sources: int, codec: "RowCodec",
                                 prefix: int, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode_sum_encode` of each slice of ``run`` (``buf``: their rows side by side,
        ``sources x D`` of them) with the seed ``fold_seed(prefix, k)``, into its columns of
        ``out`` (uint8 ``[D, run.nbytes(codec)]``, contiguous), returned."""
        if not self.exact and not codec.exact and self._slices_fuse(run, buf, codec):
            tk = _tk()
            tk.dequantize_into(
                tk.Packed.sliced(buf), groups=(run.stop - run.start) // self.group_size, bits=self.bits,
                group_size=self.group_size, symmetric=self.symmetric, sources=sources, outputs=out.shape[0],
                row_o=1, row_j=out.shape[0],
                requantize=(tk.Packed.sliced(out), codec.bits, codec.symmetric, codec.rounding, None),
                slices=self._slices(run, prefix, codec),
            )
            return out
        bounds, cols, cols2 = run.bounds(), run.columns(self), run.columns(codec)
        dests = out.shape[0]
        batchable = codec._batches_rows(run.per) and not codec._fused(buf)
        for i0, i1 in self._batches(run, buf.shape[0], buf):
            if i1 - i0 == 1 or not batchable:
                for i in range(i0, i1):
                    (a, b), (c0, c1), (e0, e1) = bounds[i], cols[i], cols2[i]
                    self.decode_sum_encode(buf[:, c0:c1], b - a, sources=sources, codec=codec,
                                           seed=fold_seed(prefix, run.first + i), out=out[:, e0:e1])
                continue
            (c0, _), (_, c1), (e0, _), (_, e1) = cols[i0], cols[i1 - 1], cols2[i0], cols2[i1 - 1]
            # [slices, sources, D, per] -> the left-to-right sum over the sources, [slices, D, per]
            values = self._decode_batch(buf[:, c0:c1].view(buf.shape[0], i1 - i0, -1).transpose(0, 1), run.per)
            total = _sum_dim1(values.view(i1 - i0, sources, dests, run.per))
            codec._encode_batch(total, _seeds(prefix, run.first + i0, run.first + i1), out[:, e0:e1],
                                transformed=True)
        return out

    def decode_sum_slices(self, buf: torch.Tensor, run: SliceRun, out: torch.Tensor, *, divisor: int = 1,
                          flag: torch.Tensor | None = None) -> torch.Tensor:
        """``out[a:b] = decode_sum(slice's columns of buf, b - a, finish=True)`` for each slice
        ``[a, b)`` of ``run``; ``out``: float32 ``[run.end]`` (or longer), returned. Fused only
        (:meth:`fuses_slices`): ``out`` may be shorter than ``run.end`` (the padding is not
        stored) and of any of fp32/bf16/fp16, ``divisor`` and ``flag`` as in
        :meth:`decode_sum_finished_into`."""
        if not self.exact and self._slices_fuse(run, buf):
            tk = _tk()
            hb = self.hadamard_block
            span = out[run.start:run.stop]
            tk.dequantize_into(
                tk.Packed.sliced(buf), groups=(run.stop - run.start) // self.group_size, bits=self.bits,
                group_size=self.group_size, symmetric=self.symmetric, sources=buf.shape[0], outputs=1, row_o=1,
                row_j=1, out=span.view(1, -1), length=span.numel(), inverse_block=hb,
                slices=self._slices(run, 0), divisor=divisor, flag=flag,
            )
            return out
        if divisor != 1 or flag is not None or out.dtype != torch.float32:
            raise ValueError("decode_sum_slices divides, casts and watches on the fused path only")
        bounds, cols = run.bounds(), run.columns(self)
        for i0, i1 in self._batches(run, buf.shape[0], buf):
            (a, _), (_, b), (c0, _), (_, c1) = bounds[i0], bounds[i1 - 1], cols[i0], cols[i1 - 1]
            if i1 - i0 == 1:
                out[a:b] = self.decode_sum(buf[:, c0:c1], b - a, finish=True)
                continue
            values = self._decode_batch(buf[:, c0:c1].view(buf.shape[0], i1 - i0, -1).transpose(0, 1), run.per)
            total = _sum_dim1(values)  # [slices, per]: each slice's rows summed left to right
            if self.hadamard_block:
                total = inverse_hadamard(total, block=self.hadamard_block)
            out[a:b].view(i1 - i0, run.per).copy_(total)
        return out

    # The torch reference takes the equal slices of a run together (cache-sized batches of them on
    # CPU): each step is then one torch call for all of them, each slice still with its own seed,
    # its own groups and the bytes of its own call. One call per slice would pay torch's
    # per-operation cost (microseconds, more than the arithmetic of a small slice) per slice.

    def _batches_rows(self, length: int) -> bool:
        """Whether slices of ``length`` elements can be encoded as rows of one
        :func:`~qsdp.codecs.quantize.quantize_rows_reference` call: whole codec units, whole bytes."""
        return not self.exact and self.padded_len(length) == length and (length * self.bits) % 8 == 0

    def _batches(self, run: SliceRun, rows: int, t: torch.Tensor) -> list[tuple[int, int]]:
        """The slices of ``run`` (indices ``[i0, i1)`` into its bounds) that the torch reference
        takes together, ``rows`` rows of each: the equal slices in batches of about a cache-sized
        chunk on CPU (all of them elsewhere); a shorter last slice, or every slice where they
        cannot be batched (the fused path, the exact codec), alone."""
        bounds = run.bounds()
        if self._fused(t) or not self._batches_rows(run.per):
            return [(i, i + 1) for i in range(run.count)]
        equal = run.count - (bounds[-1][1] - bounds[-1][0] != run.per)
        batches = _group_chunks(equal * rows * run.per, rows * run.per, t.device) if equal else []
        return batches + [(equal, run.count)] * (equal < run.count)

    def _encode_batch(self, values: torch.Tensor, seeds: list[int], out: torch.Tensor, *,
                      transformed: bool = False) -> torch.Tensor:
        """``values``: float ``[S, R, per]``, ``S`` slices of ``R`` rows; ``out``: uint8 ``[R, S *
        row_nbytes(per)]`` (columns of a send buffer). Slice ``s`` is ``encode(values[s],
        seed=seeds[s], transformed=transformed)`` into its columns of ``out`` (returned)."""
        slices, rows, per = values.shape
        if self.hadamard_block and not transformed:
            values = hadamard(values, block=self.hadamard_block)  # blockwise: no block spans two slices
        codes, scales, zeros = quantize_rows_reference(
            values.reshape(slices, rows * per), bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, rounding=self.rounding, seeds=seeds,
        )
        dest = out.view(rows, slices, -1)
        col = 0
        for part in (scales, zeros, codes):
            if part is not None:
                part = part.view(slices, rows, -1).view(torch.uint8).transpose(0, 1)
                dest[:, :, col : col + part.shape[2]] = part
                col += part.shape[2]
        if dest.shape[2] > col:
            dest[:, :, col:].zero_()  # each row's 4-byte padding, as _alloc zeroes it
        return out

    def _decode_batch(self, buf: torch.Tensor, length: int) -> torch.Tensor:
        """``buf``: uint8 ``[A, B, row_nbytes(length)]`` (any strides), each ``[a, b]`` an encoded
        row. Returns float32 ``[A, B, length]``, the rows decoded (in the Hadamard domain)."""
        a, b, _ = buf.shape
        sb = length // self.group_size * 4
        scales = buf[:, :, :sb].contiguous().view(torch.float32).reshape(-1)
        off, zeros = sb, None
        if not self.symmetric:
            zeros = buf[:, :, off : off + sb].contiguous().view(torch.float32).reshape(-1)
            off += sb
        codes = buf[:, :, off : off + length * self.bits // 8].reshape(-1)
        q = QTensor(codes, scales, zeros, torch.Size([a * b * length]), torch.float32,
                    self.bits, self.group_size, self.symmetric)
        return dequantize(q).view(a, b, length)

    def _sum_sources(
        self, buf: torch.Tensor, length: int, sources: int, *, finish: bool
    ) -> tuple[torch.Tensor, bool]:
        """(``[D, padded_len]``, False): row ``n`` sums the dequantized rows ``j * D + n``, ``j <
        sources``. With ``finish``, (``[D, length]`` after the inverse Hadamard, True) when the
        kernel fuses it; otherwise finishing is left to the caller."""
        lp = self.padded_len(length)
        dests = buf.shape[0] // sources
        if not self._fused(buf):
            return self._sum_sources_reference(buf, length, sources), False
        tk = _tk()
        hb = self.hadamard_block if finish else 0
        if hb and not tk.fuses_hadamard(self.group_size, hb):
            hb = 0
        finished = finish and (hb > 0 or not self.hadamard_block)
        width = length if finished else lp
        out = torch.empty(dests, width, dtype=torch.float32, device=buf.device)
        tk.dequantize_into(
            self._packed(buf, lp), groups=lp // self.group_size, bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, sources=sources, outputs=dests, row_o=1, row_j=dests,
            out=out, length=width, inverse_block=hb,
        )
        return out, finished

    def _sum_sources_reference(self, buf: torch.Tensor, length: int, sources: int) -> torch.Tensor:
        """``sum_rows(decode(buf, length, keep_padding=True).view(sources, D, -1))``, the same
        additions in the same order, decoding a few sources at a time."""
        lp = self.padded_len(length)
        dests = buf.shape[0] // sources
        total: torch.Tensor | None = None
        for j0, j1 in _row_chunks(sources, dests * lp, buf.device):
            part = self.decode(buf[j0 * dests : j1 * dests], length, keep_padding=True).view(j1 - j0, dests, lp)
            if total is None:
                total = _sum_dim1(part.transpose(0, 1))
            else:
                for rows in part:
                    total.add_(rows)
        return total

    def _fused(self, t: torch.Tensor) -> bool:
        return not self.exact and use_triton(t) and _supported(self.bits, self.group_size)

    def fuses_rows(self, t: torch.Tensor) -> bool:
        """Whether rows on tensors like ``t`` are encoded (and decoded, finished) by one kernel
        launch each, reading the rows themselves: the fused path, the Hadamard transform inside."""
        hb = self.hadamard_block
        return self._fused(t) and (not hb or _tk().fuses_hadamard(self.group_size, hb))

    def _alloc(self, rows: int, lp: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed rows for ``lp`` elements (``out``, checked, where given), the 4-byte padding
        zeroed."""
        width = self.row_nbytes(lp)
        if out is None:
            out = torch.empty(rows, width, dtype=torch.uint8, device=device)
        else:
            _check_out(out, rows, width)
        used = (lp // self.group_size) * 4 * (1 if self.symmetric else 2) + lp * self.bits // 8
        if width > used:
            out[:, used:].zero_()
        return out

    def _kernel_rows(self, rows: int, lp: int, device, out: torch.Tensor | None) -> torch.Tensor:
        """Packed rows a kernel can write into: ``out`` itself where it is contiguous, else new
        ones (the kernels write contiguous rows only; :func:`_deliver` copies them into a strided
        ``out``)."""
        return self._alloc(rows, lp, device, out if out is not None and out.is_contiguous() else None)

    def _packed(self, buf: torch.Tensor, lp: int):
        return _tk().Packed.rows(buf.contiguous(), padded=lp, bits=self.bits, group_size=self.group_size,
                                 symmetric=self.symmetric)

    def _encode_fused(self, x: torch.Tensor, base: torch.Tensor | None, *, seed: int, transformed: bool,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        tk = _tk()
        rows, length = x.shape
        lp = self.padded_len(length)
        hb = 0 if transformed else self.hadamard_block
        if hb and not tk.fuses_hadamard(self.group_size, hb):
            # The butterfly in torch is exact on any device; only the quantization is fused.
            xp = _pad_cols(x.float() if base is None else x.float() - base.float(), lp)
            x, base, length, hb = hadamard(xp, block=hb), None, lp, 0
        packed = self._kernel_rows(rows, lp, x.device, out)
        tk.quantize_into(
            x, self._packed(packed, lp), length=length, padded=lp, ncodes=lp, bits=self.bits,
            group_size=self.group_size, symmetric=self.symmetric, rounding=self.rounding, seed=seed,
            base=base, hadamard_block=hb,
        )
        return _deliver(packed, out)

    def _decode_fused(self, buf: torch.Tensor, lp: int, out: torch.Tensor, *, add: bool) -> torch.Tensor:
        rows = buf.shape[0]
        _tk().dequantize_into(
            self._packed(buf, lp), groups=lp // self.group_size, bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, sources=1, outputs=rows, row_o=1, row_j=0, out=out,
            length=out.shape[1], add=add,
        )
        return out


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _seeds(prefix: int, first: int, end: int) -> list[int]:
    """The seeds of rounding slices ``first .. end - 1`` (:class:`SliceRun`)."""
    return [fold_seed(prefix, k) for k in range(first, end)]


def _sum_dim1(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0] + x[:, 1] + ...`` added left to right, as :func:`sum_rows` adds (a new tensor)."""
    total = x[:, 0] + x[:, 1] if x.shape[1] > 1 else x[:, 0].clone()
    for j in range(2, x.shape[1]):
        total += x[:, j]
    return total


_TK = None


def _tk():
    # Imported at first use (triton is optional), then kept: a steady call asks many times.
    global _TK
    if _TK is None:
        from ..codecs import triton_kernels

        _TK = triton_kernels
    return _TK


@contextlib.contextmanager
def recording(fused: bool):
    """The kernel launches (:class:`qsdp.codecs.triton_kernels.Launch`) the codec steps inside
    make, in order, for a plan to launch again with a later call's tensors; with ``fused``
    false (the torch reference), an empty list."""
    if not fused:
        yield []
        return
    with _tk().recording() as launches:
        yield launches


def _padding_from(codec: RowCodec, length: int) -> int | None:
    """Where the 4-byte padding of ``codec``'s encoded row of ``length`` elements starts (``None``:
    it has none): :meth:`RowCodec._alloc` zeroes it."""
    if codec.exact:
        return None
    lp = codec.padded_len(length)
    used = (lp // codec.group_size) * 4 * (1 if codec.symmetric else 2) + lp * codec.bits // 8
    return used if codec.row_nbytes(lp) > used else None


def launch_keys(seeds: CallSeeds, *roundings: str | None) -> CallSeeds:
    """``seeds`` as its calls' kernel launches take them (the rounding keys: :func:`~qsdp.codecs.rng.launch_key`),
    tail ``i``'s for a launch rounding with ``roundings[i]`` (``None``: a sliced launch, keyed by
    its slices' prefix): a steady call looks its keys up and folds nothing on the host."""
    tk = _tk()
    return CallSeeds(seeds.prefix, seeds.tails, keys=tuple(tk.launch_keying(r) for r in roundings))


def takes_keys(keys: CallSeeds, *launches) -> bool:
    """Whether ``launches`` (one for each tail of ``keys``, in order) take their keys as
    ``keys`` (:func:`launch_keys`) gives them: what a plan checks before it keeps them."""
    return tuple(launch.keying for launch in launches) == keys.keys


def one_launch(launches: list):
    """The one launch of ``launches`` (a step's :func:`recording`) in one grid, else ``None``:
    what a plan can launch again."""
    return launches[0] if len(launches) == 1 and len(launches[0].grids) == 1 else None


# Fixed by the codecs and the run alone: computed once for each (a steady call asks again and again).
@functools.lru_cache(maxsize=None)
def _supported(bits: int, group_size: int) -> bool:
    return _tk().supports(bits=bits, group_size=group_size)


@functools.lru_cache(maxsize=4096)
def _slices_fuse_of(codec: RowCodec, run: SliceRun, other: RowCodec | None, max_tile: int) -> bool:
    return codec._slices_fuse_uncached(run, other)
