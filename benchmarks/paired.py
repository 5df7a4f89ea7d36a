"""Paired comparisons over seeds: a variant's relative gap to the baseline and its t interval.

Each seed fixes the initial weights and the batches, so a variant and the baseline trained with
the same seed differ only in what travelled on the wire; the per-seed gaps are then paired
samples, and their spread (not the spread of either loss across seeds) bounds the mean gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


def _t_density(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_half(x: float, df: int, intervals: int = 2048) -> float:
    """P(T <= x) for x >= 0: one half plus Simpson's rule over the density on [0, x]."""
    h = x / intervals
    inner = sum((4 if i % 2 else 2) * _t_density(i * h, df) for i in range(1, intervals))
    return 0.5 + h / 3 * (_t_density(0.0, df) + inner + _t_density(x, df))


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0.5 <= p < 1``).

    ``t_quantile(0.975, df)`` is the half-width factor of a two-sided 95% interval.
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    lo, hi = 0.0, 1.0
    while _t_cdf_above_half(hi, df) < p:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf_above_half(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class PairedGap:
    """Relative gaps ``variant / baseline - 1`` of one metric, one per seed, and their summary.

    ``ci_low``/``ci_high`` bound the mean gap at ``level`` (t distribution over the paired gaps);
    ``None`` with a single seed, where no interval can be estimated.
    """

    seeds: tuple[int, ...]
    gaps: tuple[float, ...]
    mean: float
    ci_low: float | None
    ci_high: float | None
    level: float

    def to_dict(self) -> dict[str, Any]:
        return {"seeds": list(self.seeds), "per_seed": list(self.gaps), "mean": self.mean,
                "ci_low": self.ci_low, "ci_high": self.ci_high, "level": self.level}


def paired_gap(variant: Sequence[float], baseline: Sequence[float], seeds: Sequence[int],
               level: float = 0.95) -> PairedGap:
    """The paired relative gaps of ``variant`` to ``baseline`` (same order, one value per seed)."""
    if not len(variant) == len(baseline) == len(seeds) or not seeds:
        raise ValueError(f"need one value per seed on both sides, got {len(variant)}, "
                         f"{len(baseline)} for {len(seeds)} seeds")
    gaps = tuple(v / b - 1.0 for v, b in zip(variant, baseline))
    n = len(gaps)
    mean = sum(gaps) / n
    if n < 2:
        return PairedGap(tuple(seeds), gaps, mean, None, None, level)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return PairedGap(tuple(seeds), gaps, mean, mean - half, mean + half, level)
