"""Interval statistics for comparisons that are repeated a few times: timing rounds, seeds.

Two situations, two intervals:

- Paired timings (ours and a reference timed in the same round): the per-round ratios cancel a
  shared machine's slow drifts, but their distribution is skewed by bursts of other load, so the
  median is reported with a distribution-free interval (binomial order statistics).
- A metric averaged over seeds (a final loss, an accuracy): the mean with a Student-t interval,
  the usual assumption for a handful of independent runs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def median_confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the median: order statistics x_(l) and x_(n+1-l), with l the
    largest rank whose binomial(n, 1/2) tail stays within (1 - level) / 2; None when even the
    extremes do not reach `level` (below 6 values at 95%)."""
    xs, n = sorted(values), len(values)
    tail, rank = 0.0, 0
    while rank <= n:
        tail += math.comb(n, rank) / 2**n  # P(fewer than rank + 1 of the n values below the median)
        if tail > (1 - level) / 2:
            break
        rank += 1
    return (xs[rank - 1], xs[n - rank]) if rank >= 1 else None


@dataclass(frozen=True)
class PairedRatio:
    """Median of the per-round ratios, with quartiles (None below 4 rounds) and the median's
    distribution-free interval (None with too few rounds to reach its level)."""
    median: float
    quartiles: tuple[float, float] | None
    interval: tuple[float, float] | None
    rounds: int


def paired_ratio(times: Sequence[float], reference: Sequence[float], level: float = 0.95) -> PairedRatio:
    """The paired comparison of two timings taken round by round: the ratios times[i] / reference[i],
    both timed in the same round, minutes apart at most, so slow drifts of a shared machine cancel out."""
    if len(times) != len(reference):
        raise ValueError(f"paired timings need as many rounds on both sides, got {len(times)} and {len(reference)}")
    ratios = sorted(a / b for a, b in zip(times, reference))
    if not ratios:
        raise ValueError("paired timings need at least one round")
    quartiles = None
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        quartiles = (q1, q3)
    return PairedRatio(statistics.median(ratios), quartiles, median_confidence_interval(ratios, level), len(ratios))


@dataclass(frozen=True)
class MeanInterval:
    """Mean over runs (seeds) with its sample standard deviation (ddof=1) and Student-t interval;
    std and the interval are None for a single run."""
    mean: float
    std: float | None
    low: float | None
    high: float | None
    n: int
    level: float


def mean_t_interval(values: Sequence[float], level: float = 0.95) -> MeanInterval:
    """mean +- t_{(1+level)/2, n-1} * s / sqrt(n): the interval for the mean of a few independent
    runs (seeds) whose values are roughly normal."""
    from scipy.stats import t as student_t  # scipy only where an interval is asked for

    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("a mean needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    mean = statistics.fmean(xs)
    if n == 1:
        return MeanInterval(mean, None, None, None, 1, level)
    std = statistics.stdev(xs)
    half = float(student_t.ppf((1 + level) / 2, n - 1)) * std / math.sqrt(n)
    return MeanInterval(mean, std, mean - half, mean + half, n, level)
