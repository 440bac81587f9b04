"""ancre_dit.evaluation.stats: the median's distribution-free interval (binomial order statistics),
paired per-round ratios, and the Student-t interval of a mean over seeds, against hand computations."""
from __future__ import annotations

import math
import statistics

import pytest
from scipy.stats import t as student_t

from ancre_dit.evaluation.stats import mean_t_interval, median_confidence_interval, paired_ratio


def test_median_interval_is_the_binomial_order_statistics():
    """n=10: x_(2)..x_(9) covers the median with 97.9% (x_(3)..x_(8) only 89%); n=6: x_(1)..x_(6)
    (96.9%); five values cannot reach 95% (two-sided 1/16 > 5%)."""
    assert median_confidence_interval([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)
    assert median_confidence_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert median_confidence_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_paired_ratio_is_the_median_of_the_per_round_ratios_with_quartiles_and_interval():
    times, reference = [2.0, 3.0, 4.0, 9.0, 5.0, 6.0], [1.0, 2.0, 2.0, 3.0, 5.0, 4.0]
    ratios = sorted(a / b for a, b in zip(times, reference))  # 1.0, 1.5, 1.5, 2.0, 2.0, 3.0
    stats = paired_ratio(times, reference)
    assert stats.median == statistics.median(ratios) == 1.75 and stats.rounds == 6
    assert stats.quartiles == tuple(statistics.quantiles(ratios, n=4)[::2])
    assert stats.interval == (1.0, 3.0)  # n=6: the extremes (96.9%)
    assert paired_ratio([2.0, 3.0], [1.0, 1.0]).quartiles is None
    with pytest.raises(ValueError, match="as many rounds"):
        paired_ratio([1.0, 2.0], [1.0])


def test_t_interval_of_the_mean_matches_a_hand_computation():
    """Three seeds 0.40, 0.42, 0.47: mean 0.43, s = sqrt(((-0.03)^2 + (-0.01)^2 + 0.04^2) / 2) = sqrt(0.0013),
    half width t_{0.975, 2} * s / sqrt(3) with t_{0.975, 2} = 4.3027."""
    result = mean_t_interval([0.40, 0.42, 0.47])
    s = math.sqrt(0.0013)
    half = student_t.ppf(0.975, 2) * s / math.sqrt(3)
    assert student_t.ppf(0.975, 2) == pytest.approx(4.302653, abs=1e-6)
    assert result.mean == pytest.approx(0.43) and result.std == pytest.approx(s) and result.n == 3
    assert (result.low, result.high) == (pytest.approx(0.43 - half), pytest.approx(0.43 + half))
    assert result.high - result.low == pytest.approx(2 * 4.302653 * s / math.sqrt(3), rel=1e-6)
    narrow = mean_t_interval([0.40, 0.42, 0.47], level=0.5)
    assert result.low < narrow.low < narrow.high < result.high
    single = mean_t_interval([0.5])
    assert (single.mean, single.std, single.low, single.high) == (0.5, None, None, None)
