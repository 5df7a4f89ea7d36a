"""What the reference codec steps allocate: no full-size int64 tensor anywhere on the encode and
decode paths, and no full-size float temporary inside ``quantize``.

Every tensor an aten operation returns is observed (:class:`allocations.Allocations`); a storage
not seen before is an allocation.
"""

from __future__ import annotations

import pytest
import torch

from qsdp.codecs import dequantize, quantize
from qsdp.comm.wire import RowCodec
from allocations import Allocations

N = 1 << 20  # elements: several CPU chunks
SMALL = N  # bytes: an eighth of a full-size int64 tensor, a quarter of a float32 one


def data(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "shift"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "minmax"])
def test_quantize_allocates_no_full_size_integer_or_float_temporary(rounding, symmetric):
    x = data(N)
    with Allocations(x) as seen:
        quantize(x, bits=4, group_size=128, symmetric=symmetric, rounding=rounding, seed=1)
    assert seen.largest(torch.int64, torch.int32) < SMALL, seen.new
    assert seen.largest(torch.float32, torch.float64) < SMALL, seen.new
    assert seen.largest(torch.uint8) == N  # the unpacked codes, one byte each, are the largest buffer


def test_dequantize_allocates_only_its_output_at_full_size():
    q = quantize(data(N), bits=4, group_size=128, symmetric=True, rounding="stochastic", seed=1)
    with Allocations(q.codes, q.scales) as seen:
        out = dequantize(q)
    assert seen.largest(torch.int64, torch.int32) < SMALL, seen.new
    full_floats = [b for _, d, b in seen.new if d == torch.float32 and b >= N]
    assert full_floats == [out.untyped_storage().nbytes()], seen.new


CODEC = RowCodec(bits=4, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
HOP1 = RowCodec(bits=8, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)


@pytest.mark.parametrize("step", ["encode", "encode_difference", "decode_sum", "decode_sum_encode", "decode_into"])
def test_row_codec_steps_allocate_no_full_size_int64(step):
    rows, length = 8, N // 8
    x = data(rows, length)
    base = data(rows, length, dtype=torch.bfloat16)
    buf = HOP1.encode(x, seed=2)
    calls = {
        "encode": lambda: CODEC.encode(x, seed=1),
        "encode_difference": lambda: CODEC.encode_difference(x.bfloat16(), base, seed=1),
        "decode_sum": lambda: HOP1.decode_sum(buf, length, finish=True),
        "decode_sum_encode": lambda: HOP1.decode_sum_encode(buf, length, sources=4, codec=CODEC, seed=3),
        "decode_into": lambda: HOP1.decode_into(buf, length, base, add=True),
    }
    with Allocations(x, base, buf) as seen:
        calls[step]()
    assert seen.new and seen.largest(torch.int64) < SMALL, seen.new


@pytest.mark.parametrize("step", ["decode_into", "decode_into_add", "decode_sum"])
def test_decoding_every_peer_row_makes_no_temporary_of_the_whole_buffer(step):
    # A gathered or received buffer holds one row per peer: the reference decodes a few rows at
    # a time, so its float temporaries stay far below the rows' total (the output aside).
    rows, length = 8, N // 8
    buf = HOP1.encode(data(rows, length), seed=2)
    out = data(rows, length, dtype=torch.bfloat16)
    calls = {
        "decode_into": lambda: HOP1.decode_into(buf, length, out),
        "decode_into_add": lambda: HOP1.decode_into(buf, length, out, add=True),
        "decode_sum": lambda: HOP1.decode_sum(buf, length),  # output: one row
    }
    with Allocations(buf, out) as seen:
        calls[step]()
    assert 0 < seen.largest(torch.float32, torch.float64, torch.bfloat16) <= 4 * length, seen.new
