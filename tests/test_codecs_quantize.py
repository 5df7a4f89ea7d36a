"""Specification tests for ``qsdp.codecs.quantize`` (and the counter-based random numbers).

Every bound is checked per element against the scale of the element's own group. "Step" below
means that scale: the distance between two neighbouring levels of the group's grid.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsdp.codecs import QTensor, dequantize, quantize, rng, unpack_codes

BITS = (2, 4, 8)
ROUNDINGS = ("nearest", "stochastic", "shift")
RANDOM_ROUNDINGS = ("stochastic", "shift")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCHEMES = list(itertools.product(BITS, (True, False)))  # (bits, symmetric)
EPS32 = torch.finfo(torch.float32).eps


def scheme_id(scheme) -> str:
    bits, symmetric = scheme
    return f"{bits}bit-{'sym' if symmetric else 'minmax'}"


# ----------------------------------------------------------------------------- helpers


def per_element(group_values: torch.Tensor, q: QTensor) -> torch.Tensor:
    """Broadcast one value per group to one value per element of the flattened tensor."""
    return group_values.repeat_interleave(q.group_size)[: q.numel]


def element_scales(q: QTensor) -> torch.Tensor:
    return per_element(q.scales, q)


def element_zeros(q: QTensor) -> torch.Tensor:
    if q.zeros is None:
        return torch.zeros(q.numel)
    return per_element(q.zeros, q)


def float_tolerance(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """A few fp32 ulps of every quantity the round trip adds or multiplies (value, zero point and
    the largest level times the step): the codec computes in fp32, the bounds are exact maths."""
    span = (2**q.bits) * element_scales(q)
    return 8 * EPS32 * (x.abs() + element_zeros(q).abs() + span)


def round_trip_error(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """|dequantize(q) - x| per element of the flattened tensor, in fp32."""
    return (dequantize(q).reshape(-1) - x.reshape(-1).float()).abs()


def assert_error_within(x: torch.Tensor, q: QTensor, rounding: str) -> None:
    """nearest: error <= step / 2; stochastic and shift: error < step (plus float tolerance)."""
    err = round_trip_error(x, q)
    steps = element_scales(q)
    bound = steps / 2 if rounding == "nearest" else steps
    excess = err - bound - float_tolerance(x.reshape(-1).float(), q)
    if rounding == "nearest":
        bad = excess > 0
    else:  # strict: a full step of error means the rounding picked a level two steps away
        bad = (excess >= 0) & (err > 0)
    assert not bad.any(), (
        f"{int(bad.sum())} elements out of bound for {rounding}; worst error/step "
        f"{float((err / steps.clamp_min(1e-30))[bad].max()):.6f}"
    )


def codes_of(q: QTensor) -> torch.Tensor:
    return unpack_codes(q.codes, q.bits, q.numel)


# ------------------------------------------------------------------- round-trip error bounds


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nearest_rounding_error_is_at_most_half_a_step(scheme, dtype):
    bits, symmetric = scheme
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, generator=g) * 3).to(dtype)  # 3000 % 128 != 0: a partial last group
    q = quantize(x, bits=bits, group_size=128, symmetric=symmetric, rounding="nearest")
    assert_error_within(x, q, "nearest")


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_rounding_error_is_less_than_one_step(scheme, rounding, dtype):
    bits, symmetric = scheme
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3000, generator=g) * 3).to(dtype)
    q = quantize(x, bits=bits, group_size=128, symmetric=symmetric, rounding=rounding, seed=7)
    assert_error_within(x, q, rounding)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_dequantized_values_lie_on_the_group_grid(scheme, rounding):
    bits, symmetric = scheme
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    q = quantize(x, bits=bits, group_size=64, symmetric=symmetric, rounding=rounding, seed=3)
    steps = element_scales(q)
    levels = (dequantize(q) - element_zeros(q)) / steps
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        assert levels.round().abs().max() <= qmax
    else:
        assert levels.round().min() >= 0 and levels.round().max() <= 2**bits - 1


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_symmetric_scale_is_absmax_over_qmax_and_minmax_uses_range_and_minimum(scheme):
    bits, symmetric = scheme
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    q = quantize(x, bits=bits, group_size=16, symmetric=symmetric, rounding="nearest")
    assert q.scales.dtype == torch.float32 and q.scales.shape == (4,)
    if symmetric:
        assert q.zeros is None
        torch.testing.assert_close(q.scales, x.abs().amax(1) / (2 ** (bits - 1) - 1))
    else:
        assert q.zeros.dtype == torch.float32
        torch.testing.assert_close(q.zeros, x.amin(1))
        torch.testing.assert_close(q.scales, (x.amax(1) - x.amin(1)) / (2**bits - 1))


def test_partial_last_group_uses_only_its_own_elements():
    """Padding never leaks: the last group's scale comes from its real elements only."""
    x = torch.tensor([-9.0] * 8 + [0.5, 0.25, 0.125])  # padding with 0 or -9 would show
    for symmetric in (True, False):
        q = quantize(x, bits=4, group_size=8, symmetric=symmetric, rounding="nearest")
        assert q.scales.numel() == 2 and q.codes.numel() == math.ceil(11 * 4 / 8)
        if symmetric:
            assert q.scales[1].item() == pytest.approx(0.5 / 7)
        else:
            assert q.zeros[1].item() == 0.125
            assert q.scales[1].item() == pytest.approx(0.375 / 15)
        assert_error_within(x, q, "nearest")


# --------------------------------------------------------------------------- unbiasedness

N_TRIALS = 400
# One rounding of an element whose value sits a fraction f of a step above a level has variance
# f (1 - f) step^2 <= step^2 / 4, i.e. standard deviation <= step / 2. The mean of N independent
# roundings then has standard deviation <= step / (2 sqrt(N)); allow six of those.
SIGMAS = 6.0
C_UNBIASED = SIGMAS * 0.5


def mean_over_seeds(x, *, bits, group_size, symmetric, rounding, n_trials=N_TRIALS):
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(n_trials):
        q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding,
                     seed=seed)
        total += dequantize(q).reshape(-1).double()
    return total / n_trials, q


def assert_unbiased(x, *, bits, group_size, symmetric, rounding, n_trials=N_TRIALS):
    """|mean over seeds of dequantize(quantize(x)) - x| <= C * step / sqrt(n_trials), per element."""
    mean, q = mean_over_seeds(x, bits=bits, group_size=group_size, symmetric=symmetric,
                              rounding=rounding, n_trials=n_trials)
    steps = element_scales(q).double()
    deviation = (mean - x.reshape(-1).double()).abs()
    bound = C_UNBIASED * steps / math.sqrt(n_trials) + float_tolerance(x.reshape(-1), q).double()
    statistic = float((deviation / bound).max())
    assert statistic <= 1.0, f"{rounding}: worst |mean - x| is {statistic:.2f} times the bound"


def crafted_biased_input(bits: int, symmetric: bool) -> torch.Tensor:
    """Groups of 8 whose step is exactly 1 and whose other elements all sit 0.3 of a step above a
    level: nearest rounding moves every one of them by 0.3 steps in the same direction."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        ends = [float(qmax), -float(qmax)]  # absmax = qmax: step 1
    else:
        ends = [0.0, float(2**bits - 1)]  # min 0, range 2**bits - 1: step 1
    inner = [(k % max(1, 2 ** (bits - 1) - 1)) + 0.3 for k in range(6)]
    return torch.tensor((ends + inner) * 4)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
def test_random_rounding_is_unbiased_over_seeds(scheme, rounding):
    bits, symmetric = scheme
    x = torch.randn(256, generator=torch.Generator().manual_seed(5))
    assert_unbiased(x, bits=bits, group_size=32, symmetric=symmetric, rounding=rounding)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
def test_random_rounding_is_unbiased_on_the_crafted_input(scheme, rounding):
    bits, symmetric = scheme
    x = crafted_biased_input(bits, symmetric)
    assert_unbiased(x, bits=bits, group_size=8, symmetric=symmetric, rounding=rounding)


@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_unbiasedness_check_rejects_nearest_rounding_on_the_crafted_input(symmetric):
    """The statistical test has power: nearest rounding, biased by 0.3 steps on every inner
    element, fails it (0.3 * sqrt(400) = 6 standard errors > the allowed 3)."""
    x = crafted_biased_input(4, symmetric)
    mean, q = mean_over_seeds(x, bits=4, group_size=8, symmetric=symmetric, rounding="nearest")
    deviation = (mean - x.double()).abs()
    bound = C_UNBIASED * element_scales(q).double() / math.sqrt(N_TRIALS)
    assert (deviation > bound).sum() == 24  # every inner element, none of the exact ends
    with pytest.raises(AssertionError):
        assert_unbiased(x, bits=4, group_size=8, symmetric=symmetric, rounding="nearest")


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_same_seed_gives_identical_codes(rounding, symmetric):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6))
    kw = dict(bits=4, group_size=32, symmetric=symmetric, rounding=rounding)
    a, b = quantize(x, seed=123, **kw), quantize(x, seed=123, **kw)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
@pytest.mark.parametrize("seeds", [(0, 1), (123, 124), (1, 2**32), (2**32, 2**33), (5, -5)],
                         ids=str)
def test_different_seeds_give_different_codes(rounding, seeds):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(7))
    kw = dict(bits=4, group_size=32, symmetric=True, rounding=rounding)
    a, b = (quantize(x, seed=s, **kw) for s in seeds)
    assert not torch.equal(a.codes, b.codes)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_codes_of_a_prefix_match_for_its_full_groups(rounding, symmetric):
    """The random bits are a function of (seed, index) alone: quantizing a prefix of the tensor
    gives the same codes on the prefix's full groups."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    kw = dict(bits=4, group_size=64, symmetric=symmetric, rounding=rounding, seed=99)
    full, prefix = quantize(x, **kw), quantize(x[:700], **kw)
    n_full = (700 // 64) * 64
    assert torch.equal(codes_of(full)[:n_full], codes_of(prefix)[:n_full])
    assert torch.equal(full.scales[: 700 // 64], prefix.scales[: 700 // 64])


@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
def test_codes_do_not_depend_on_the_shape_only_on_flat_index(rounding):
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(9))
    kw = dict(bits=2, group_size=16, symmetric=False, rounding=rounding, seed=5)
    assert torch.equal(quantize(x, **kw).codes, quantize(x.reshape(-1), **kw).codes)
    assert torch.equal(quantize(x, **kw).codes, quantize(x.reshape(6, 4, 40), **kw).codes)


@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
def test_identical_groups_are_rounded_with_different_random_bits(rounding):
    """The index is the element's (or group's) position in the whole tensor, not in its group."""
    group = torch.linspace(-1, 1, 64)
    x = group.repeat(8)
    q = quantize(x, bits=2, group_size=64, symmetric=True, rounding=rounding, seed=11)
    per_group = codes_of(q).view(8, 64)
    assert len({tuple(row.tolist()) for row in per_group}) > 1


def test_codes_do_not_depend_on_torch_global_random_state_when_seeded():
    x = torch.randn(512, generator=torch.Generator().manual_seed(10))
    kw = dict(bits=4, group_size=32, symmetric=True, rounding="stochastic", seed=42)
    torch.manual_seed(0)
    a = quantize(x, **kw)
    torch.manual_seed(1)
    torch.rand(100)
    b = quantize(x, **kw)
    assert torch.equal(a.codes, b.codes)


@pytest.mark.parametrize("rounding", RANDOM_ROUNDINGS)
def test_seed_none_still_rounds_within_one_step(rounding):
    x = torch.randn(700, generator=torch.Generator().manual_seed(11))
    q = quantize(x, bits=4, group_size=64, symmetric=True, rounding=rounding)
    assert_error_within(x, q, rounding)


def test_stochastic_rounding_actually_randomizes():
    """Not nearest in disguise: across seeds an element between two levels takes both."""
    x = torch.full((64,), 0.3)
    x[0] = 7.0  # step 1 for 4-bit symmetric
    seen = set()
    for seed in range(50):
        q = quantize(x, bits=4, group_size=64, symmetric=True, rounding="stochastic", seed=seed)
        seen.update(dequantize(q)[1:].unique().tolist())
    assert seen == {0.0, 1.0}


def test_uniform_is_a_pure_function_of_seed_and_index():
    a = rng.uniform(3, 100)
    assert torch.equal(a, rng.uniform(3, 100))
    assert torch.equal(a[40:], rng.uniform(3, 60, offset=40))
    assert not torch.equal(a, rng.uniform(4, 100))
    assert not torch.equal(a, rng.uniform(3, 100, stream=1))


def test_uniform_values_are_in_unit_interval_and_look_uniform():
    u = rng.uniform(2024, 200_000)
    assert u.dtype == torch.float32
    assert u.min() >= 0 and u.max() < 1
    # mean 1/2 and variance 1/12, each within many standard errors
    assert abs(u.double().mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / u.numel())
    assert abs(u.double().var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected).abs() < 6 * math.sqrt(expected)).all()


# ------------------------------------------------------------------------------ edge inputs


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)], ids=str)
def test_empty_tensor_round_trips_to_an_empty_tensor(scheme, rounding, shape):
    bits, symmetric = scheme
    x = torch.empty(shape, dtype=torch.bfloat16)
    q = quantize(x, bits=bits, group_size=32, symmetric=symmetric, rounding=rounding, seed=0)
    assert q.nbytes_on_wire == 0 and q.codes.numel() == 0 and q.scales.numel() == 0
    out = dequantize(q, dtype=torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("value", [0.0, 2.5, -3.0, 1e-3])
def test_single_element_is_reconstructed_without_nan(scheme, rounding, value):
    bits, symmetric = scheme
    x = torch.tensor([value])
    q = quantize(x, bits=bits, group_size=128, symmetric=symmetric, rounding=rounding, seed=0)
    out = dequantize(q)
    assert out.shape == (1,) and torch.isfinite(out).all()
    assert_error_within(x, q, rounding)
    if not symmetric or value == 0.0:
        assert out.item() == x.item()
    else:  # the value is its group's absmax: the top level, up to fp32 rounding of the step
        assert out.item() == pytest.approx(x.item(), rel=2 * EPS32)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zeros_reconstruct_exactly_without_nan(scheme, rounding, dtype):
    bits, symmetric = scheme
    x = torch.zeros(5, 37, dtype=dtype)
    q = quantize(x, bits=bits, group_size=16, symmetric=symmetric, rounding=rounding, seed=1)
    assert torch.isfinite(q.scales).all() and (q.scales == 0).all()
    out = dequantize(q, dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, x)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_groups_reconstruct_exactly_with_minmax(bits, rounding, dtype):
    values = torch.tensor([3.0, -1.5, 0.1, 1e4, -7e-3, 0.0, 42.0])
    x = values.repeat_interleave(16).to(dtype)  # 7 constant groups of 16
    q = quantize(x, bits=bits, group_size=16, symmetric=False, rounding=rounding, seed=2)
    assert (q.scales == 0).all()
    out = dequantize(q, dtype=dtype)
    assert torch.equal(out, x)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_groups_reconstruct_to_fp32_rounding_with_symmetric(bits, rounding, dtype):
    """A constant group's value is its absmax, i.e. the top level qmax * step; the fp32 step
    absmax / qmax times qmax is the value up to one rounding (not always bit-exact)."""
    values = torch.tensor([3.0, -1.5, 0.1, 1e4, -7e-3, 0.0, 42.0])
    x = values.repeat_interleave(16).to(dtype)
    q = quantize(x, bits=bits, group_size=16, symmetric=True, rounding=rounding, seed=2)
    out = dequantize(q)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, x.float(), rtol=2 * EPS32, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_returns_the_requested_dtype_and_the_input_shape(dtype, out_dtype):
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(12)).to(dtype)
    q = quantize(x, bits=8, group_size=32, symmetric=True, rounding="nearest")
    assert q.shape == x.shape and q.dtype == dtype
    out = dequantize(q, dtype=out_dtype)
    assert out.shape == x.shape and out.dtype == out_dtype
    assert dequantize(q).dtype == torch.float32


@pytest.mark.parametrize("shape", [(), (7,), (4, 9), (2, 3, 5), (2, 1, 3, 1, 4)], ids=str)
def test_multi_dimensional_shapes_quantize_their_flattened_elements(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(13))
    kw = dict(bits=4, group_size=5, symmetric=False, rounding="stochastic", seed=3)
    q = quantize(x, **kw)
    flat = quantize(x.reshape(-1), **kw)
    assert torch.equal(q.codes, flat.codes) and torch.equal(q.scales, flat.scales)
    out = dequantize(q)
    assert out.shape == x.shape
    assert torch.equal(out.reshape(-1), dequantize(flat))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_non_contiguous_input_is_quantized_in_logical_order(rounding):
    base = torch.randn(16, 30, generator=torch.Generator().manual_seed(14))
    kw = dict(bits=4, group_size=8, symmetric=True, rounding=rounding, seed=4)
    for x in (base.t(), base[:, ::3], base[::2, 1:]):
        assert not x.is_contiguous()
        q = quantize(x, **kw)
        ref = quantize(x.contiguous(), **kw)
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
        assert torch.equal(dequantize(q), dequantize(ref))
        assert_error_within(x, q, rounding)


def test_input_requiring_grad_is_accepted_and_left_untouched():
    x = torch.randn(100, requires_grad=True)
    before = x.detach().clone()
    q = quantize(x, bits=4, group_size=32, symmetric=True, rounding="stochastic", seed=0)
    assert not dequantize(q).requires_grad
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_symmetric_never_uses_the_most_negative_code(bits, rounding):
    """Levels are -qmax..qmax: for 4 bits the code of -8 (offset-binary 0) never appears."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(4096, generator=g)
    x[::16] = -x[::16].abs() * 10  # many negative group extremes
    x[1::64] = -1e6
    q = quantize(x, bits=bits, group_size=16, symmetric=True, rounding=rounding, seed=6)
    codes = codes_of(q)
    assert codes.min() >= 1 and codes.max() <= 2**bits - 1
    assert (codes == 1).any()  # -qmax does occur
    assert (dequantize(q) / element_scales(q)).round().min() >= -(2 ** (bits - 1) - 1)


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_non_finite_input_raises_naming_how_many(dtype, symmetric):
    x = torch.randn(100).to(dtype)
    x[3], x[50], x[99] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"\b3 non-finite"):
        quantize(x, bits=4, group_size=32, symmetric=symmetric, rounding="nearest")
    x = torch.ones(10, dtype=dtype)
    x[0] = float("nan")
    with pytest.raises(ValueError, match=r"\b1 non-finite"):
        quantize(x, bits=8, group_size=4, symmetric=symmetric, rounding="stochastic", seed=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
def test_unchecked_non_finite_input_shows_in_the_scales(bad, symmetric):
    x = torch.ones(64)
    x[40] = bad
    q = quantize(x, bits=4, group_size=32, symmetric=symmetric, rounding="nearest",
                 check_finite=False)
    assert torch.isfinite(q.scales[0]) and not torch.isfinite(q.scales[1])


def _valid(**over):
    kw = dict(bits=4, group_size=32, symmetric=True, rounding="nearest")
    kw.update(over)
    return kw


@pytest.mark.parametrize("bits", [3, 16, True, 0, 4.0, "4", None], ids=repr)
def test_bad_bits_raise_naming_the_value_and_the_allowed_ones(bits):
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")) as info:
        quantize(torch.randn(10), **_valid(bits=bits))
    assert "2, 4, 8" in str(info.value)


@pytest.mark.parametrize("group_size", [0, -1, 1.5, True, "32", None], ids=repr)
def test_bad_group_size_raises_naming_the_value_and_what_is_allowed(group_size):
    with pytest.raises(ValueError, match=re.escape(f"group_size={group_size!r}")) as info:
        quantize(torch.randn(10), **_valid(group_size=group_size))
    assert "positive integer" in str(info.value)


@pytest.mark.parametrize("rounding", ["up", "Nearest", "", None], ids=repr)
def test_bad_rounding_raises_naming_the_value_and_the_allowed_ones(rounding):
    with pytest.raises(ValueError, match=re.escape(f"rounding={rounding!r}")) as info:
        quantize(torch.randn(10), **_valid(rounding=rounding))
    for allowed in ROUNDINGS:
        assert allowed in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool,
                                   torch.float64], ids=str)
def test_unsupported_dtype_raises_naming_it_and_the_allowed_ones(dtype):
    x = torch.zeros(10, dtype=dtype)
    with pytest.raises(ValueError, match=re.escape(str(dtype))) as info:
        quantize(x, **_valid())
    for allowed in ("float32", "bfloat16", "float16"):
        assert allowed in str(info.value)


def test_bad_arguments_are_rejected_even_for_an_empty_tensor():
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.empty(0), **_valid(bits=3))
    with pytest.raises(ValueError, match="int64"):
        quantize(torch.empty(0, dtype=torch.int64), **_valid())


# ---------------------------------------------------------------------- property-based tests


@st.composite
def tensors(draw):
    """A float tensor of a drawn shape, dtype and kind of content (generated by torch from a
    drawn seed so that large tensors stay cheap)."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["gaussian", "uniform", "sparse", "constant", "outliers", "ties"]))
    magnitude = 10.0 ** draw(st.integers(-6 if dtype != torch.float16 else -3, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = math.prod(shape)
    if kind == "gaussian":
        x = torch.randn(n, generator=g) * magnitude
    elif kind == "uniform":
        x = (torch.rand(n, generator=g) * 2 - 1) * magnitude
    elif kind == "sparse":
        x = torch.randn(n, generator=g) * magnitude * (torch.rand(n, generator=g) < 0.2)
    elif kind == "constant":
        x = torch.full((n,), draw(st.sampled_from([0.0, 1.0, -2.5, 0.1])) * magnitude)
    elif kind == "outliers":
        x = torch.randn(n, generator=g) * magnitude
        x[torch.rand(n, generator=g) < 0.05] *= 100
    else:  # small integers and halves: exact ties for nearest rounding
        x = torch.randint(-8, 9, (n,), generator=g) / 2.0
    finite = torch.finfo(dtype).max  # outliers of a large fp16 tensor must stay finite
    return x.clamp(-finite, finite).reshape(shape).to(dtype)


scheme_strategy = dict(
    bits=st.sampled_from(BITS),
    group_size=st.one_of(st.integers(1, 40), st.sampled_from([64, 128, 1000])),
    symmetric=st.booleans(),
    rounding=st.sampled_from(ROUNDINGS),
    seed=st.integers(-(2**40), 2**40),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), **scheme_strategy)
def test_property_round_trip_respects_the_error_bound_shape_and_dtype(
    x, bits, group_size, symmetric, rounding, seed
):
    q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding,
                 seed=seed)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert q.scales.numel() == math.ceil(x.numel() / group_size)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == math.ceil(x.numel() * bits / 8)
    out = dequantize(q, dtype=x.dtype)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(dequantize(q)).all()
    assert_error_within(x, q, rounding)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False, width=32), max_size=70
    ),
    **scheme_strategy,
)
def test_property_round_trip_of_arbitrary_float32_values(
    values, bits, group_size, symmetric, rounding, seed
):
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding,
                 seed=seed)
    out = dequantize(q)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert_error_within(x, q, rounding)
    codes = codes_of(q)
    if symmetric:
        assert codes.numel() == 0 or codes.min() >= 1


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.sampled_from(BITS), group_size=st.integers(1, 40),
       symmetric=st.booleans(), rounding=st.sampled_from(ROUNDINGS), seed=st.integers(0, 2**32))
def test_property_quantize_is_deterministic_given_the_seed(
    x, bits, group_size, symmetric, rounding, seed
):
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding, seed=seed)
    a, b = quantize(x, **kw), quantize(x.clone(), **kw)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


# ------------------------------------------------------------------------------ long tensors


def plain_codes(x: torch.Tensor, *, bits, group_size, symmetric, rounding, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's definition written out on the whole tensor at once (no chunks): unpacked
    codes of the ``x.numel()`` elements and the scales."""
    n = x.numel()
    g = torch.cat([x, x[-1:].expand((-n) % group_size)]).view(-1, group_size)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scales = g.abs().amax(dim=1) / torch.tensor(float(qmax))
        v, lo, hi, offset = g / torch.where(scales > 0, scales, 1.0)[:, None], -qmax, qmax, qmax + 1
    else:
        zeros = g.amin(dim=1) + 0.0
        scales = (g.amax(dim=1) + 0.0 - zeros) / torch.tensor(float(2**bits - 1))
        v, lo, hi, offset = (g - zeros[:, None]) / torch.where(scales > 0, scales, 1.0)[:, None], 0, 2**bits - 1, 0
    if rounding == "nearest":
        r = torch.round(v)
    elif rounding == "stochastic":
        r = torch.floor(v + rng.uniform(seed, v.numel(), stream=rng.STREAM_ELEMENT).view_as(v))
    else:
        r = torch.floor(v + rng.uniform(seed, v.shape[0], stream=rng.STREAM_GROUP)[:, None])
    return (r.clamp(lo, hi) + offset).reshape(-1)[:n].to(torch.uint8), scales


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "minmax"))
@pytest.mark.parametrize("n, group_size", [(300_003, 128), (300_000, 100_000), (300_001, 3)], ids=str)
def test_long_tensors_are_quantized_as_one_piece(rounding, symmetric, n, group_size):
    """The reference works through the tensor in cache-sized pieces; the result is the
    quantizer's definition applied to the whole tensor (pieces of many groups, groups larger than
    a piece, a partial last group)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(21)) * 3
    kw = dict(bits=4, group_size=group_size, symmetric=symmetric, rounding=rounding, seed=8)
    q = quantize(x, **kw)
    codes, scales = plain_codes(x, **kw)
    assert torch.equal(codes_of(q), codes) and torch.equal(q.scales, scales)
    if symmetric:
        expected = (codes.float() - 8) * element_scales(q)
    else:
        expected = codes.float() * element_scales(q) + element_zeros(q)
    assert torch.equal(dequantize(q), expected)


# ----------------------------------------------------------------------------- the non-finite encoding


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_non_finite_group_sends_nan_bits_and_zero_codes_and_decodes_to_nan(scheme, rounding, dtype):
    """A group holding NaN, +inf or -inf: scale (and zero point) 0x7FC00000, every code 0; every
    element decodes to NaN. The finite groups are encoded as if the others were not there."""
    from qsdp.codecs.quantize import NON_FINITE_BITS

    bits, symmetric = scheme
    x = torch.randn(6 * 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1], x[16 + 7], x[32 + 15], x[48], x[49] = float("nan"), float("inf"), -float("inf"), float("inf"), -float("inf")
    bad = torch.tensor([True, True, True, True, False, False])
    kw = dict(bits=bits, group_size=16, symmetric=symmetric, rounding=rounding, seed=5, check_finite=False)
    q = quantize(x, **kw)
    assert q.scales.view(torch.int32)[bad].eq(NON_FINITE_BITS).all()
    if not symmetric:
        assert q.zeros.view(torch.int32)[bad].eq(NON_FINITE_BITS).all()
    assert unpack_codes(q.codes, bits, q.numel).view(6, 16)[bad].eq(0).all()
    assert dequantize(q).view(6, 16)[bad].isnan().all()
    finite = quantize(x[64:], **{**kw, "seed": 5})
    assert torch.equal(q.scales[4:], finite.scales) and torch.isfinite(finite.scales).all()


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_in_a_long_input_only_the_non_finite_groups_get_zero_codes(scheme, rounding):
    """Chunks of 16K elements or more take the vectorized path (NaN through the rounding, codes
    through int16): the non-finite groups' codes are 0 and every other group's are those it gets
    when the non-finite groups hold zeros instead."""
    bits, symmetric = scheme
    groups, size = 3 * 256 + 5, 128
    x = torch.randn(groups * size, generator=torch.Generator().manual_seed(7))
    bad = [0, 300, 511, 512, groups - 1]
    clean = x.clone()
    for i, g in enumerate(bad):
        x[g * size + (i * 37) % size] = (float("nan"), float("inf"), -float("inf"))[i % 3]
        clean[g * size:(g + 1) * size] = 0
    kw = dict(bits=bits, group_size=size, symmetric=symmetric, rounding=rounding, seed=11, check_finite=False)
    codes = unpack_codes(quantize(x, **kw).codes, bits, x.numel()).view(groups, size)
    expected = unpack_codes(quantize(clean, **kw).codes, bits, x.numel()).view(groups, size)
    expected[bad] = 0
    assert torch.equal(codes, expected)


def test_a_finite_group_whose_range_overflows_keeps_its_infinite_scale():
    """Only non-finite values make a group non-finite: a finite min-max range wider than fp32
    gives an infinite scale, as the arithmetic says, not the NaN encoding."""
    x = torch.tensor([3e38, -3e38, 1.0, 0.0])
    q = quantize(x, bits=8, group_size=4, symmetric=False, rounding="nearest")
    assert q.scales.item() == float("inf") and torch.equal(q.zeros, x[1:2])


# ----------------------------------------------------------------------------- rows with their own seeds


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_quantizing_rows_together_gives_the_bytes_of_each_row_alone(scheme, rounding):
    from qsdp.codecs.quantize import quantize_reference, quantize_rows_reference

    bits, symmetric = scheme
    x = torch.randn(5, 4 * 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 70] = float("nan")  # a non-finite group keeps its encoding
    seeds = [11, 2**32 + 11, 0, 2**31, 5]
    codes, scales, zeros = quantize_rows_reference(x, bits=bits, group_size=64, symmetric=symmetric,
                                                   rounding=rounding, seeds=seeds)
    for r, seed in enumerate(seeds):
        c, s, z = quantize_reference(x[r], bits=bits, group_size=64, symmetric=symmetric, rounding=rounding, seed=seed)
        assert torch.equal(codes[r], c) and torch.equal(scales[r].view(torch.int32), s.view(torch.int32))
        assert symmetric or torch.equal(zeros[r].view(torch.int32), z.view(torch.int32))


def test_quantizing_rows_needs_whole_groups_per_row():
    from qsdp.codecs.quantize import quantize_rows_reference

    with pytest.raises(ValueError, match="rows of 100 elements are not whole groups of 64"):
        quantize_rows_reference(torch.zeros(2, 100), bits=4, group_size=64, symmetric=True, rounding="nearest",
                                seeds=[1, 2])
