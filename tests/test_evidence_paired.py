"""Paired seeds: Student's t quantiles and the interval of the mean relative gap."""

import math

import pytest

from benchmarks.paired import paired_gap, t_quantile


@pytest.mark.parametrize("df,expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_the_printed_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_t_quantile_tends_to_the_normal_one():
    assert t_quantile(0.975, 10_000) == pytest.approx(1.95996, abs=1e-3)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)


def test_paired_gap_interval_is_the_t_interval_of_the_per_seed_gaps():
    base = [2.0, 2.1, 1.9, 2.05, 1.95]
    variant = [b * (1 + g) for b, g in zip(base, [0.01, 0.02, 0.0, 0.015, 0.005])]
    gap = paired_gap(variant, base, seeds=range(5))
    assert gap.gaps == pytest.approx((0.01, 0.02, 0.0, 0.015, 0.005))
    assert gap.mean == pytest.approx(0.01)
    half = 2.7764 * math.sqrt(0.00025 / 4) / math.sqrt(5)  # sample sd of the gaps is sqrt(6.25e-5)
    assert (gap.ci_low, gap.ci_high) == (pytest.approx(0.01 - half, abs=1e-6), pytest.approx(0.01 + half, abs=1e-6))


def test_paired_gap_ignores_what_the_seeds_share():
    # The baseline moves 10% between seeds, the variant follows it: the interval is tight.
    base = [2.0, 2.2, 1.8]
    gap = paired_gap([b * 1.001 for b in base], base, seeds=[0, 1, 2])
    assert gap.ci_high - gap.ci_low == pytest.approx(0.0, abs=1e-12)


def test_one_seed_has_no_interval():
    gap = paired_gap([2.2], [2.0], seeds=[7])
    assert gap.mean == pytest.approx(0.1) and gap.ci_low is None and gap.ci_high is None


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="one value per seed"):
        paired_gap([1.0, 2.0], [1.0], seeds=[0, 1])
