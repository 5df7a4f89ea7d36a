"""Specification tests for the blockwise Walsh-Hadamard transform."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsdp.codecs import dequantize, hadamard, hadamard_matrix, inverse_hadamard, quantize

BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256)


def fp32_tolerance(x: torch.Tensor, block: int) -> float:
    """Forward and inverse each sum ``block`` terms of magnitude <= max|x|: a few ulps of the
    largest element per doubling of the block."""
    if x.numel() == 0:
        return 0.0
    return 4 * math.log2(block) * torch.finfo(torch.float32).eps * x.float().abs().max().item()


@pytest.mark.parametrize("block", BLOCKS)
def test_hadamard_matrix_squared_is_block_times_identity(block):
    h = hadamard_matrix(block)
    assert h.shape == (block, block) and h.dtype == torch.float32
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h, block * torch.eye(block))
    assert torch.equal(h, h.T)


def test_hadamard_matrix_of_size_two_is_the_sylvester_seed():
    assert hadamard_matrix(2).tolist() == [[1.0, 1.0], [1.0, -1.0]]


def test_hadamard_matrix_respects_the_requested_dtype():
    assert hadamard_matrix(8, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_mutating_a_returned_hadamard_matrix_does_not_change_later_transforms():
    x = torch.arange(8.0)
    before = hadamard(x, block=4)
    hadamard_matrix(4).mul_(0)
    assert torch.equal(hadamard_matrix(4) @ hadamard_matrix(4), 4 * torch.eye(4))
    assert torch.equal(hadamard(x, block=4), before)


@pytest.mark.parametrize("block", (4, 32, 128))
def test_each_full_block_is_multiplied_by_the_hadamard_matrix(block):
    x = torch.randn(5 * block, generator=torch.Generator().manual_seed(block))
    expected = (x.view(-1, block) @ hadamard_matrix(block)).reshape(-1)
    torch.testing.assert_close(hadamard(x, block=block), expected)


def test_transform_of_a_unit_vector_is_a_row_of_the_matrix():
    x = torch.zeros(16)
    x[3] = 1.0
    assert torch.equal(hadamard(x, block=16), hadamard_matrix(16)[3])


@pytest.mark.parametrize("block", (2, 8, 32, 128))
@pytest.mark.parametrize("shape", [(0,), (1,), (256,), (300,), (7, 33), (4, 8, 16)], ids=str)
def test_inverse_undoes_the_transform_to_fp32_rounding(block, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 10
    y = hadamard(x, block=block)
    assert y.shape == x.shape and y.dtype == torch.float32
    back = inverse_hadamard(y, block=block)
    assert back.shape == x.shape
    tol = fp32_tolerance(x, block)
    torch.testing.assert_close(back, x, rtol=0, atol=tol)
    torch.testing.assert_close(hadamard(inverse_hadamard(x, block=block), block=block), x,
                               rtol=0, atol=tol)


@pytest.mark.parametrize("block", (4, 32))
def test_trailing_partial_block_is_left_unchanged(block):
    n = 3 * block + block // 2 + 1
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    y, z = hadamard(x, block=block), inverse_hadamard(x, block=block)
    tail = slice(3 * block, n)
    assert torch.equal(y[tail], x[tail]) and torch.equal(z[tail], x[tail])
    assert not torch.allclose(y[: 3 * block], x[: 3 * block])


@pytest.mark.parametrize("block", [2, 32, 1 << 16])
def test_a_long_tensor_is_transformed_block_by_block(block):
    """Blocks are independent: a tensor far longer than the transform's working pieces (with a
    partial tail) gives, bit for bit, what its block-aligned halves give on their own."""
    x = torch.randn(3 * (1 << 16) + 5, generator=torch.Generator().manual_seed(4))
    cut = (x.numel() // 2) // block * block
    for f in (hadamard, inverse_hadamard):
        halves = torch.cat([f(x[:cut], block=block), f(x[cut:], block=block)])
        assert torch.equal(f(x, block=block), halves)


def test_tensor_shorter_than_a_block_is_left_unchanged():
    x = torch.randn(31)
    assert torch.equal(hadamard(x, block=32), x)


def test_transform_preserves_energy_up_to_the_block_factor():
    x = torch.randn(1024, generator=torch.Generator().manual_seed(2))
    y = hadamard(x, block=64)
    assert y.pow(2).sum().item() == pytest.approx(64 * x.pow(2).sum().item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_low_precision_input_is_transformed_in_fp32(dtype):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = hadamard(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, hadamard(x.float()))
    torch.testing.assert_close(inverse_hadamard(y), x.float(), rtol=0, atol=1e-5)


def test_non_contiguous_input_is_transformed_in_logical_order():
    base = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    x = base.t()
    assert not x.is_contiguous()
    torch.testing.assert_close(hadamard(x, block=16), hadamard(x.contiguous(), block=16))


def test_input_is_not_modified():
    x = torch.randn(64)
    before = x.clone()
    hadamard(x, block=32)
    inverse_hadamard(x, block=32)
    assert torch.equal(x, before)


@pytest.mark.parametrize("block", (32, 128))
def test_hadamard_before_4bit_quantization_lowers_the_error_on_outliers(block):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16384, generator=g)
    outliers = torch.randperm(x.numel(), generator=g)[:16]
    x[outliers] *= 100
    kw = dict(bits=4, group_size=128, symmetric=True, rounding="nearest")

    plain = dequantize(quantize(x, **kw))
    mse_plain = (plain - x).pow(2).mean().item()

    transformed = hadamard(x, block=block)
    smoothed = inverse_hadamard(dequantize(quantize(transformed, **kw)), block=block)
    mse_hadamard = (smoothed - x).pow(2).mean().item()

    assert mse_hadamard < mse_plain


@pytest.mark.parametrize("block", [0, 1, 3, 48, -4, 2.0, "32"], ids=repr)
def test_bad_block_sizes_raise_naming_the_value_and_what_is_allowed(block):
    for fn in (hadamard, inverse_hadamard):
        with pytest.raises(ValueError, match=f"block={block!r}".replace(".", r"\.")) as info:
            fn(torch.randn(64), block=block)
        assert "power of two" in str(info.value)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(block)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    block=st.sampled_from(BLOCKS),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_property_inverse_hadamard_round_trip(shape, block, seed, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = hadamard(x, block=block)
    assert y.shape == x.shape and y.dtype == torch.float32
    back = inverse_hadamard(y, block=block)
    torch.testing.assert_close(back, x.float(), rtol=0, atol=fp32_tolerance(x, block))


def test_a_shapes_butterfly_is_planned_once_and_reused_by_later_transforms():
    from qsdp.codecs.hadamard import _Butterfly

    x = torch.randn(2, 1792, generator=torch.Generator().manual_seed(3))
    first = hadamard(x, block=32)
    planned = _Butterfly.built
    for _ in range(5):  # the forward and the inverse of the shape share its plan
        assert torch.equal(hadamard(x, block=32), first)
        assert torch.equal(inverse_hadamard(first, block=32), inverse_hadamard(first, block=32))
    assert _Butterfly.built == planned


def test_threads_transforming_at_once_do_not_share_scratch():
    from concurrent.futures import ThreadPoolExecutor

    inputs = [torch.randn(4, 512, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    expected = [hadamard(x, block=64) for x in inputs]

    def many(i: int) -> bool:
        return all(torch.equal(hadamard(inputs[i], block=64), expected[i]) for _ in range(200))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(many, [0, 1]))
