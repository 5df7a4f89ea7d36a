"""The counter-based generator behind stochastic and shift rounding.

What it must be: a pure function of (seed, stream, index) that the tensor code computes exactly
as the Python-integer specification (:func:`qsdp.codecs.rng.hash32`) across chunk boundaries and
the 32-bit wrap of the index; and, statistically, uniform with no dependence between neighbouring
indices, neighbouring seeds or streams. The statistical checks are two-sided chi-square tests
(too regular fails as well as too uneven) at five standard deviations; each is shown to reject a
flawed sequence, so they can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qsdp.codecs import rng

N = 1 << 20


def chi_square_z(counts: torch.Tensor) -> float:
    """Standard score of Pearson's chi-square statistic of ``counts`` against equal expected
    counts (Wilson-Hilferty: (X/k)^(1/3) is close to normal with k degrees of freedom)."""
    counts = counts.double().reshape(-1)
    expected = counts.sum() / counts.numel()
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = counts.numel() - 1
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def histogram_z(u: torch.Tensor, bins: int = 256) -> float:
    return chi_square_z(torch.histc(u, bins=bins, min=0, max=1))


def pairs_z(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    """Chi-square score of the 2-D histogram of the pairs ``(a[i], b[i])``: uniform over the
    unit square when a and b are independent uniforms."""
    cell = (a * bins).long() * bins + (b * bins).long()
    return chi_square_z(torch.bincount(cell, minlength=bins * bins))


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def looks_independent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return abs(pairs_z(a, b)) < 5 and abs(correlation(a, b)) < 5 / math.sqrt(a.numel())


def weyl(n: int) -> torch.Tensor:
    """A flawed generator: ``frac(i * golden ratio)``, perfectly even and perfectly predictable."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * 0x9E3779B1) & 0xFFFFFFFF) >> 8).float() / 2**24


# ----------------------------------------------------------------------------- the specification


@pytest.mark.parametrize("offset", [0, 65_530, 2**32 - 70_000, 5 * 2**32 + 3], ids=str)
def test_uniform_is_the_top_24_bits_of_the_integer_hash(offset):
    n = 140_000  # crosses CPU chunk boundaries
    u = rng.uniform(77, n, offset=offset, stream=3)
    key = rng.seed_key(77, 3)
    for i in [0, 1, 65_535, 65_536, 65_537, 131_072, n - 1]:
        assert u[i].item() == (rng.hash32(offset + i, key) >> 8) / 2**24


def test_add_uniform_adds_exactly_the_uniform_numbers():
    v = torch.randn(3, 70_001, generator=torch.Generator().manual_seed(0))
    w = rng.add_uniform_(v.clone(), 9, offset=12, stream=1)
    assert torch.equal(w, v + rng.uniform(9, v.numel(), offset=12, stream=1).view_as(v))


@pytest.mark.parametrize("rows,n", [(8, 2048), (3, 70_001)], ids=["rows-per-chunk", "chunks-per-row"])
def test_each_row_gets_the_numbers_of_its_own_seed(rows, n):
    seeds = [0, 2**31, 2**32 - 1, 2**40 + 5, 7, 1, 99, 12345][:rows]
    v = torch.randn(rows, n, generator=torch.Generator().manual_seed(1))
    w = rng.add_uniform_rows_(v.clone(), seeds, offset=2**32 - 40, stream=rng.STREAM_ELEMENT)
    u = rng.uniform_rows(seeds, n, stream=2)
    for r, seed in enumerate(seeds):
        assert torch.equal(w[r], rng.add_uniform_(v[r].clone(), seed, offset=2**32 - 40, stream=rng.STREAM_ELEMENT))
        assert torch.equal(u[r], rng.uniform(seed, n, stream=2))


@pytest.mark.parametrize("per_row", [False, True], ids=["one-key", "a-key-per-row"])
def test_the_int32_arithmetic_of_other_devices_gives_the_cpu_paths_bits(per_row):
    # CPU tensors hash in numpy's uint32, other devices in torch's int32: one specification.
    keys, n, start = [rng.seed_key(s, 1) for s in (3, 2**31 + 7)], 4096, 2**32 - 1000
    ramp = rng._golden_ramp(n, torch.device("cpu"))
    if per_row:
        terms = [[start * 0x9E3779B1 + k for k in keys], [k ^ (k >> 16) for k in keys]]
        on_cpu = rng._uniform_bits_cpu(*(np.array([v & 0xFFFFFFFF for v in t], dtype=np.uint32)[:, None]
                                         for t in terms), (2, n))
        first, key = (torch.tensor([rng._s32(v) for v in t], dtype=torch.int32)[:, None] for t in terms)
        shape, expected = (2, n), [[rng.hash32(start + i, k) >> 8 for i in range(n)] for k in keys]
    else:
        first, key, shape = start, keys[0], (n,)
        on_cpu = rng._uniform_bits_cpu(first, key, shape)
        expected = [rng.hash32(start + i, keys[0]) >> 8 for i in range(n)]
    assert on_cpu.tolist() == expected
    buffers = (torch.empty(shape, dtype=torch.int32) for _ in range(2))
    assert rng._uniform_bits_int32(first, key, ramp, *buffers).tolist() == expected


def test_threads_drawing_at_once_do_not_share_a_buffer():
    # A CPU draw fills its thread's buffer: another thread's draws must not overwrite it.
    from concurrent.futures import ThreadPoolExecutor

    expected = [rng.uniform(seed, 5000, stream=1) for seed in (1, 2)]

    def many(i: int) -> bool:
        return all(torch.equal(rng.uniform(i + 1, 5000, stream=1), expected[i]) for _ in range(300))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(many, [0, 1]))


def test_add_uniform_rows_wants_a_seed_per_row():
    with pytest.raises(ValueError, match="2 seeds for 3 rows"):
        rng.add_uniform_rows_(torch.zeros(3, 4), [1, 2])


@pytest.mark.parametrize("bad", [torch.zeros(8, dtype=torch.float64), torch.zeros(4, 4).t()], ids=["fp64", "strided"])
def test_add_uniform_rejects_what_it_cannot_update_in_place(bad):
    with pytest.raises(ValueError, match="contiguous float32"):
        rng.add_uniform_(bad, 1)


def test_seeds_are_plain_python_integers_of_32_bits():
    for value in (rng.seed_key(2**40 + 5, 2), rng.derive_seed(1, 2, 3, -4)):
        assert type(value) is int and 0 <= value < 2**32


def test_seed_key_separates_the_high_and_low_words():
    assert rng.seed_key(1) != rng.seed_key(2**32)
    assert rng.seed_key(1 + (2 << 32)) != rng.seed_key(2 + (1 << 32))


# ----------------------------------------------------------------------------- statistics


def test_the_checks_reject_a_flawed_sequence():
    u = weyl(N)
    assert abs(histogram_z(u)) >= 5  # too even to be random
    assert not looks_independent(u[:-1], u[1:])


@pytest.mark.parametrize("seed", [0, 1, 2024, 2**31 - 1])
def test_histogram_is_uniform(seed):
    assert abs(histogram_z(rng.uniform(seed, N, stream=rng.STREAM_ELEMENT))) < 5


@pytest.mark.parametrize("lag", [1, 2, 16])
def test_neighbouring_indices_are_independent(lag):
    u = rng.uniform(5, N + lag, stream=rng.STREAM_ELEMENT)
    assert looks_independent(u[:-lag], u[lag:])


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1, 2**32])
def test_neighbouring_seeds_are_independent(seed):
    assert looks_independent(rng.uniform(seed, N), rng.uniform(seed + 1, N))


@pytest.mark.parametrize("streams", [(0, 1), (rng.STREAM_ELEMENT, rng.STREAM_GROUP), (2, 3)], ids=str)
def test_neighbouring_streams_are_independent(streams):
    a, b = (rng.uniform(11, N, stream=s) for s in streams)
    assert looks_independent(a, b)


def test_derived_seeds_of_neighbouring_steps_are_independent():
    """The seeds of consecutive steps (or ranks) of one collective: every bit set about half the
    time, and their first draws uniform."""
    seeds = torch.tensor([rng.derive_seed(1234, 3, step, 0) for step in range(4096)], dtype=torch.int64)
    bits = (seeds.unsqueeze(1) >> torch.arange(32)) & 1
    assert ((bits.sum(0).double() - 2048).abs() < 5 * math.sqrt(1024)).all()
    first = torch.cat([rng.uniform(int(s), 1) for s in seeds])
    assert abs(histogram_z(first, bins=16)) < 5


# ----------------------------------------------------------------------------- a comm's call seeds


TAILS = ((0, 7, 1), (5, 7, 2), (123456789012,), ())


@pytest.mark.parametrize("calls", [range(0, 2100), [0, 9, 10, 99, 100, 10**6 - 1, 10**6, 2**32 - 1, 2**32, 2**40 + 3]],
                         ids=["consecutive", "digit-boundaries"])
def test_a_call_seeds_table_gives_fold_seeds_integers(calls):
    # across batch boundaries, and where a part gains a decimal digit (fold_seed's stream)
    prefix = rng.derive_seed(3, 1)
    table = rng.CallSeeds(prefix, TAILS)
    for call in calls:
        assert table(call) == tuple(rng.fold_seeds(prefix, call, *tail) for tail in TAILS), call


def test_a_call_seeds_table_follows_a_resumed_or_repeated_call():
    prefix = rng.derive_seed(9)
    table = rng.CallSeeds(prefix, ((2, 4),))
    order = [5000, 5001, 17, 18, 5000, 5000, 3 * rng.CallSeeds.BATCH, 0]
    assert [table(c) for c in order] == [(rng.fold_seeds(prefix, c, 2, 4),) for c in order]


def test_a_call_seeds_table_takes_32_bit_prefixes_and_non_negative_parts():
    with pytest.raises(ValueError, match="prefix"):
        rng.CallSeeds(2**32, ((1,),))
    with pytest.raises(ValueError, match="parts"):
        rng.CallSeeds(1, ((1, -1),))


def _launch_key_by_hand(seed: int, key: int) -> int:
    # the specification: nothing for no stream, else the int32 bits of the seed or of its stream key
    if key < 0:
        return 0
    v = seed if key == 0 else rng.seed_key(seed, key)
    return (v & 0xFFFFFFFF) - (1 << 32) * ((v >> 31) & 1)


@pytest.mark.parametrize("calls", [range(0, 1100), [9, 10, 2**32, 2**63 - 5]], ids=["consecutive", "far"])
def test_a_keyed_call_seeds_table_gives_each_tails_launch_key(calls):
    # what a steady call's launches take, looked up: in a batch, across its edge, and far past any
    prefix = rng.derive_seed(4, 2)
    keys = (-1, 0, rng.STREAM_ELEMENT, rng.STREAM_GROUP)
    seeds, keyed = rng.CallSeeds(prefix, TAILS), rng.CallSeeds(prefix, TAILS, keys=keys)
    for call in calls:
        assert keyed(call) == tuple(_launch_key_by_hand(s, k) for s, k in zip(seeds(call), keys)), call
    assert rng.CallSeeds(prefix, TAILS, keys=(None, 0, 1, 2))(7)[0] == seeds(7)[0]  # None: the seed itself


def test_a_keyed_call_seeds_table_needs_a_key_for_each_tail():
    with pytest.raises(ValueError, match="one entry for each"):
        rng.CallSeeds(1, ((1,), (2,)), keys=(0,))
