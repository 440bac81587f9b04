"""Post-hoc EMA's mathematics against direct computations: the std of a power-function profile, the
discrete tracking rule, the profiles' inner products (numerical integration) and the reconstruction
of an EMA length that was never tracked (an EMA of that length run over the same toy sequence)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.integrate import quad

from ancre_dit.training.phema import (exponent_of_std, profile_inner_product, reconstruction_weights,
                                      std_of_exponent, tracking_beta)


@pytest.mark.parametrize("std", [0.01, 0.05, 0.08, 0.10, 0.2])
def test_std_and_exponent_invert_each_other(std):
    g = exponent_of_std(std)
    assert g > 0 and std_of_exponent(g) == pytest.approx(std, rel=1e-10)
    # The std of the density (g + 1) u^g on [0, 1], integrated numerically.
    mean = quad(lambda u: u * (g + 1) * u ** g, 0, 1)[0]
    var = quad(lambda u: (u - mean) ** 2 * (g + 1) * u ** g, 0, 1)[0]
    assert np.sqrt(var) == pytest.approx(std, rel=1e-6)


def _track(values: np.ndarray, std: float, snapshot_every: int | None = None):
    """Runs the tracking rule over values[0..N-1] (step s = 1..N); returns the final EMA and the
    snapshots {step: value}."""
    ema, snapshots = 0.0, {}
    for s, v in enumerate(values, start=1):
        beta = tracking_beta(std, s)
        ema = beta * ema + (1 - beta) * v
        if snapshot_every and s % snapshot_every == 0:
            snapshots[s] = ema
    return ema, snapshots


def test_tracking_follows_the_profile():
    """The weight the EMA at step N gives step s, (1 - beta_s) times the later betas, has the
    profile's relative standard deviation; and it is what the EMA gives an impulse at step s."""
    n, std = 2000, 0.08
    betas = np.array([tracking_beta(std, s) for s in range(1, n + 1)])
    weights = (1 - betas) * np.append(np.cumprod(betas[::-1])[::-1][1:], 1.0)
    for s in (0, 700, 1999):
        assert _track(np.eye(n)[s], std)[0] == pytest.approx(weights[s], rel=1e-9)
    steps = np.arange(1, n + 1) / n
    assert weights.sum() == pytest.approx(1.0)
    mean = (weights * steps).sum()
    assert np.sqrt((weights * (steps - mean) ** 2).sum()) == pytest.approx(std, rel=0.02)
    assert tracking_beta(std, 1) == 0.0  # the first update copies the model


@pytest.mark.parametrize("t_a, std_a, t_b, std_b", [(100, 0.05, 100, 0.10), (60, 0.05, 100, 0.10),
                                                    (100, 0.10, 40, 0.05), (1e6, 0.01, 5e5, 0.2)])
def test_inner_products_are_the_integrals_of_the_profiles(t_a, std_a, t_b, std_b):
    g_a, g_b = exponent_of_std(std_a), exponent_of_std(std_b)

    def density(t, g):
        return lambda s: (g + 1) * (s / t) ** g / t

    pa, pb = density(t_a, g_a), density(t_b, g_b)
    direct = quad(lambda s: pa(s) * pb(s), 0, min(t_a, t_b), limit=200)[0]
    assert profile_inner_product(np.float64(t_a), g_a, np.float64(t_b), g_b) == pytest.approx(direct, rel=1e-6)


@pytest.mark.parametrize("target_std", [0.06, 0.08])
def test_a_length_never_tracked_is_rebuilt_from_two_tracked_ones(target_std):
    """A toy weight trajectory (drift plus noise): snapshots of the 0.05 and 0.10 EMAs every 25 steps
    rebuild the target EMA at the last step to within a small fraction of the trajectory's range."""
    rng = np.random.default_rng(0)
    n, every = 1000, 25
    values = np.cumsum(rng.normal(size=n)) + 5 * np.sin(np.arange(n) / 80)
    steps, stds, snapshot_values = [], [], []
    for std in (0.05, 0.10):
        _, snapshots = _track(values, std, every)
        steps += list(snapshots)
        stds += [std] * len(snapshots)
        snapshot_values += list(snapshots.values())
    x = reconstruction_weights(steps, stds, n, target_std)
    rebuilt = float(np.dot(x, snapshot_values))
    direct, _ = _track(values, target_std)
    other, _ = _track(values, 0.05)
    assert x.sum() == pytest.approx(1.0)
    assert abs(rebuilt - direct) < 0.01 * np.ptp(values)
    assert abs(rebuilt - direct) < 0.2 * abs(other - direct)  # far closer than the nearest tracked EMA
