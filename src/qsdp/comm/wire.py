"""The wire format of a collective: rows of a matrix, each row one destination's (or source's)
data, encoded into equal-sized uint8 rows that an all-gather or all-to-all moves.

A row of ``L`` elements is padded to ``L_pad``, a whole number of quantization groups (and of
Hadamard blocks), by repeating its last element (which changes no group's min, max or absmax).
Its bytes are ``[fp32 scales][fp32 zero points (min-max only)][packed codes]``, padded to a
multiple of 4 bytes so that every row's scales stay aligned. All of this padding travels and is
metered. An unquantized codec sends the raw fp32 (or parameter-dtype) bytes of the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs import dequantize, hadamard, inverse_hadamard, quantize
from ..codecs.quantize import QTensor


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)


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

    @property
    def exact(self) -> bool:
        return self.bits is None

    def padded_len(self, length: int) -> int:
        if self.exact or length == 0:
            return length
        unit = math.lcm(self.group_size, self.hadamard_block) if self.hadamard_block else self.group_size
        return -(-length // unit) * unit

    def row_nbytes(self, length: int) -> int:
        if self.exact:
            return length * self.raw_dtype.itemsize
        lp = self.padded_len(length)
        groups = lp // self.group_size
        n = groups * 4 * (1 if self.symmetric else 2) + lp * self.bits // 8
        return -(-n // 4) * 4

    def encode(self, x: torch.Tensor, *, seed: int, transformed: bool = False) -> torch.Tensor:
        """``x``: ``[R, L]`` float. Returns uint8 ``[R, row_nbytes(L)]``. ``transformed`` says the
        rows are already in the Hadamard domain (padded to whole blocks)."""
        rows, length = x.shape
        if self.exact:
            return x.to(self.raw_dtype).contiguous().view(torch.uint8).view(rows, -1)
        lp = self.padded_len(length)
        xp = _pad_cols(x.float(), lp)
        if self.hadamard_block and not transformed:
            xp = hadamard(xp, block=self.hadamard_block)
        q = quantize(
            xp, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
            rounding=self.rounding, seed=seed, check_finite=False,
        )
        parts = [q.scales.view(rows, -1).view(torch.uint8)]
        if q.zeros is not None:
            parts.append(q.zeros.view(rows, -1).view(torch.uint8))
        parts.append(q.codes.view(rows, -1))
        out = torch.cat(parts, dim=1)
        width = self.row_nbytes(length)
        if out.shape[1] < width:
            out = torch.cat([out, out.new_zeros(rows, width - out.shape[1])], dim=1)
        return out

    def decode(self, buf: torch.Tensor, length: int, *, keep_padding: bool = False) -> torch.Tensor:
        """``buf``: uint8 ``[R, row_nbytes(length)]``. Returns float32 ``[R, length]`` (or
        ``[R, padded_len(length)]`` with ``keep_padding``), still in the Hadamard domain."""
        rows = buf.shape[0]
        if self.exact:
            return buf.contiguous().view(self.raw_dtype).view(rows, length).float()
        lp = self.padded_len(length)
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

    def finish(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Leave the Hadamard domain (rows padded to whole blocks) and drop the padding."""
        if self.hadamard_block and not self.exact:
            x = inverse_hadamard(x, block=self.hadamard_block)
        return x[..., :length]
