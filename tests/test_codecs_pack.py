"""Specification tests for bit packing and the wire format of ``QTensor``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsdp.codecs import (
    QTensor,
    dequantize,
    pack_codes,
    packed_nbytes,
    quantize,
    unpack_codes,
    wire_nbytes,
)

BITS = (2, 4, 8)
SCHEMES = list(itertools.product(BITS, (True, False)))


def scheme_id(scheme) -> str:
    bits, symmetric = scheme
    return f"{bits}bit-{'sym' if symmetric else 'minmax'}"


def random_codes(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


def edge_lengths(bits: int) -> list[int]:
    per_byte = 8 // bits
    return sorted({0, 1, per_byte - 1, per_byte, per_byte + 1, 2 * per_byte + 1, 7, 9, 1001})


# ------------------------------------------------------------------------------ pack/unpack


@pytest.mark.parametrize(
    "bits,n", [(b, n) for b in BITS for n in edge_lengths(b)], ids=lambda v: str(v)
)
def test_pack_then_unpack_is_lossless_at_edge_lengths(bits, n):
    codes = random_codes(n, bits, seed=n)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
    out = unpack_codes(packed, bits, n)
    assert out.dtype == torch.uint8 and torch.equal(out, codes)


@settings(max_examples=150, deadline=None)
@given(bits=st.sampled_from(BITS), data=st.data())
def test_property_pack_then_unpack_is_lossless(bits, data):
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=300))
    codes = torch.tensor(values, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == math.ceil(len(values) * bits / 8)
    assert unpack_codes(packed, bits, len(values)).tolist() == values


@pytest.mark.parametrize("bits", BITS)
def test_all_code_values_survive_packing(bits):
    codes = torch.arange(2**bits, dtype=torch.int64).to(torch.uint8).repeat(3)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, codes.numel()), codes)


def test_four_bit_codes_share_a_byte_low_nibble_first():
    codes = torch.tensor([0x1, 0x2, 0xF, 0x0, 0x7], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [0x21, 0x0F, 0x07]


def _low_nibble_first(codes: torch.Tensor) -> list[int]:
    """The 4-bit packing by its definition, byte by byte."""
    values = codes.tolist() + [0] * (codes.numel() % 2)
    return [lo | hi << 4 for lo, hi in zip(values[0::2], values[1::2])]


@pytest.mark.parametrize("n", [(1 << 14) - 1, 1 << 14, (1 << 14) + 1, 3 * (1 << 14) + 7])
def test_long_runs_of_four_bit_codes_pack_by_the_same_rule(n):
    """Long runs are packed and unpacked two codes at a time as int16 pairs: the same bytes as
    the rule, and back."""
    codes = random_codes(n, 4, seed=n)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == _low_nibble_first(codes)
    assert torch.equal(unpack_codes(packed, 4, n), codes)
    # Unpacked from a longer buffer (the prefix is read), as the wire's rows hold it.
    longer = torch.cat([packed, torch.full((5,), 0xFF, dtype=torch.uint8)])
    assert torch.equal(unpack_codes(longer, 4, n), codes)


def test_a_run_of_codes_at_an_odd_offset_packs_as_a_copy_of_it_does():
    codes = random_codes(3 * (1 << 14) + 1, 4, seed=1)[1:]
    assert codes.storage_offset() == 1
    assert torch.equal(pack_codes(codes, 4), pack_codes(codes.clone(), 4))
    assert pack_codes(codes, 4).tolist() == _low_nibble_first(codes)


def test_two_bit_codes_share_a_byte_lowest_bits_first():
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [0b00_11_10_01, 0b11]


def test_eight_bit_codes_are_stored_as_they_are():
    codes = torch.tensor([0, 1, 128, 255], dtype=torch.uint8)
    assert pack_codes(codes, 8).tolist() == [0, 1, 128, 255]


@pytest.mark.parametrize("bits", BITS)
def test_unpack_reads_only_the_requested_prefix_of_a_longer_buffer(bits):
    codes = random_codes(37, bits, seed=1)
    packed = torch.cat([pack_codes(codes, bits), torch.full((5,), 0xFF, dtype=torch.uint8)])
    assert torch.equal(unpack_codes(packed, bits, 37), codes)


@pytest.mark.parametrize("bits", BITS)
def test_unpack_of_a_too_short_buffer_raises(bits):
    packed = pack_codes(random_codes(40, bits), bits)
    with pytest.raises(ValueError, match="needed"):
        unpack_codes(packed[:-1], bits, 40)


@pytest.mark.parametrize("bits", [1, 3, 16])
def test_pack_and_unpack_reject_unsupported_bits(bits):
    with pytest.raises(ValueError, match=f"bits={bits}"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match=f"bits={bits}"):
        unpack_codes(torch.zeros(8, dtype=torch.uint8), bits, 8)


# ------------------------------------------------------------------------- QTensor wire format


def buffer_bytes(q: QTensor) -> int:
    n = q.codes.numel() * q.codes.element_size() + q.scales.numel() * q.scales.element_size()
    if q.zeros is not None:
        n += q.zeros.numel() * q.zeros.element_size()
    return n


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 1000, 4096])
@pytest.mark.parametrize("group_size", [1, 7, 128])
def test_nbytes_on_wire_equals_buffer_sizes_and_wire_nbytes(scheme, numel, group_size):
    bits, symmetric = scheme
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, rounding="nearest")
    expected = wire_nbytes(numel, bits=bits, group_size=group_size, symmetric=symmetric)
    assert q.nbytes_on_wire == buffer_bytes(q) == expected == q.to_bytes().numel()
    n_groups = math.ceil(numel / group_size)
    assert expected == math.ceil(numel * bits / 8) + n_groups * 4 * (1 if symmetric else 2)


def test_four_bit_group_128_symmetric_costs_4_25_bits_per_element():
    n = 128 * 1024
    assert wire_nbytes(n, bits=4, group_size=128, symmetric=True) * 8 / n == 4.25
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    q = quantize(x, bits=4, group_size=128, symmetric=True, rounding="nearest")
    assert q.nbytes_on_wire * 8 / n == 4.25


def test_eight_bit_group_1024_minmax_costs_8_plus_64_over_1024_bits_per_element():
    n = 1024 * 64
    assert wire_nbytes(n, bits=8, group_size=1024, symmetric=False) * 8 / n == 8 + 64 / 1024
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    q = quantize(x, bits=8, group_size=1024, symmetric=False, rounding="nearest")
    assert q.nbytes_on_wire * 8 / n == 8 + 64 / 1024


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_bits_per_element_approach_the_asymptote_for_large_partial_tensors(scheme):
    bits, symmetric = scheme
    n = 10**6 + 3  # not a multiple of anything
    per_group_bits = 32 * (1 if symmetric else 2)
    got = wire_nbytes(n, bits=bits, group_size=128, symmetric=symmetric) * 8 / n
    assert got == pytest.approx(bits + per_group_bits / 128, abs=1e-3)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "shift"])
@pytest.mark.parametrize("shape", [(0,), (1,), (5, 7), (3, 100), (2, 3, 65)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_to_bytes_from_bytes_round_trip(scheme, rounding, shape, dtype):
    bits, symmetric = scheme
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = quantize(x, bits=bits, group_size=32, symmetric=symmetric, rounding=rounding, seed=3)
    buf = q.to_bytes()
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == q.nbytes_on_wire
    r = QTensor.from_bytes(buf.clone(), shape=shape, dtype=dtype, bits=bits, group_size=32,
                           symmetric=symmetric)
    assert r.shape == q.shape and r.dtype == q.dtype
    assert (r.bits, r.group_size, r.symmetric) == (bits, 32, symmetric)
    assert torch.equal(r.codes, q.codes) and torch.equal(r.scales, q.scales)
    assert r.scales.dtype == torch.float32
    if symmetric:
        assert r.zeros is None
    else:
        assert torch.equal(r.zeros, q.zeros)
    assert r.nbytes_on_wire == q.nbytes_on_wire
    assert torch.equal(dequantize(r, dtype=dtype), dequantize(q, dtype=dtype))


def test_from_bytes_accepts_a_list_shape_and_a_non_flat_buffer():
    x = torch.randn(6, 10)
    q = quantize(x, bits=4, group_size=16, symmetric=False, rounding="nearest")
    buf = q.to_bytes()
    r = QTensor.from_bytes(buf.view(1, -1), shape=[6, 10], dtype=torch.float32, bits=4,
                           group_size=16, symmetric=False)
    assert r.shape == torch.Size([6, 10])
    assert torch.equal(dequantize(r), dequantize(q))


@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_from_bytes_rejects_a_buffer_of_the_wrong_size_or_dtype(symmetric):
    q = quantize(torch.randn(100), bits=4, group_size=32, symmetric=symmetric, rounding="nearest")
    buf = q.to_bytes()
    kw = dict(shape=(100,), dtype=torch.float32, bits=4, group_size=32, symmetric=symmetric)
    with pytest.raises(ValueError, match=f"{buf.numel()} bytes"):
        QTensor.from_bytes(buf[:-1], **kw)
    with pytest.raises(ValueError, match=f"{buf.numel()} bytes"):
        QTensor.from_bytes(torch.cat([buf, buf[:1]]), **kw)
    with pytest.raises(ValueError, match="int8"):
        QTensor.from_bytes(buf.view(torch.int8), **kw)


def test_from_bytes_does_not_depend_on_buffer_alignment():
    """A QTensor received at an odd offset inside a larger receive buffer still decodes."""
    q = quantize(torch.randn(300), bits=2, group_size=64, symmetric=False, rounding="shift",
                 seed=1)
    big = torch.cat([torch.zeros(3, dtype=torch.uint8), q.to_bytes()])
    r = QTensor.from_bytes(big[3:], shape=(300,), dtype=torch.float32, bits=2, group_size=64,
                           symmetric=False)
    assert torch.equal(dequantize(r), dequantize(q))


@settings(max_examples=80, deadline=None)
@given(
    numel=st.integers(0, 600),
    bits=st.sampled_from(BITS),
    group_size=st.integers(1, 300),
    symmetric=st.booleans(),
)
def test_property_wire_bytes_match_and_round_trip(numel, bits, group_size, symmetric):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, rounding="stochastic",
                 seed=numel)
    expected = wire_nbytes(numel, bits=bits, group_size=group_size, symmetric=symmetric)
    assert q.nbytes_on_wire == buffer_bytes(q) == expected
    r = QTensor.from_bytes(q.to_bytes(), shape=(numel,), dtype=torch.float32, bits=bits,
                           group_size=group_size, symmetric=symmetric)
    assert torch.equal(dequantize(r), dequantize(q))
