"""Post-hoc EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion Models"):
power-function EMAs tracked during training, and the EMA of any length rebuilt from their snapshots.

A power-function EMA with exponent g, read at step t, averages the weights of steps s in [0, t] with
density p(s) = (g + 1) s^g / t^(g + 1). Its length is given as the relative standard deviation of
that density, std = sqrt((g + 1) / ((g + 2)^2 (g + 3))) (0.05 to 0.10 are EDM2's). Tracking it
takes one lerp a step with beta_t = (1 - 1/t)^(g + 1). From snapshots of two such EMAs at many
steps, the EMA of another std at step T is the combination of snapshots whose density is closest
to the target's in L2: a linear solve of the snapshots' inner products (the paper's equations,
written here for a step count rather than images seen).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np


@lru_cache(maxsize=None)  # read at every step by the tracking rule
def exponent_of_std(std: float) -> float:
    """The exponent g whose profile has relative standard deviation `std`: the largest real root of
    std^2 (g + 2)^2 (g + 3) = g + 1, a cubic in g."""
    if not 0 < std < 12 ** -0.5:  # g = 0 (the plain average) is the widest profile: std 1/sqrt(12)
        raise ValueError(f"a power-function EMA's std lies in (0, {12 ** -0.5:.4f}), got {std}")
    k = std ** -2
    roots = np.roots([1.0, 7.0, 16.0 - k, 12.0 - k])
    return float(roots[np.abs(roots.imag) < 1e-9].real.max())


def std_of_exponent(exponent: float) -> float:
    g = float(exponent)
    return float(np.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))))


def tracking_beta(std: float, step: int) -> float:
    """The decay of the update at optimizer step `step` (1-based) that keeps the EMA on the profile."""
    return (1.0 - 1.0 / step) ** (exponent_of_std(std) + 1.0)


def profile_inner_product(t_a: np.ndarray, g_a: np.ndarray, t_b: np.ndarray, g_b: np.ndarray) -> np.ndarray:
    """The integral of p_a(s) p_b(s) over s, for profiles read at t_a, t_b with exponents g_a, g_b:
    (g_a + 1)(g_b + 1) m^(g_a + g_b + 1) / ((g_a + g_b + 1) t_a^(g_a + 1) t_b^(g_b + 1)), m = min(t_a, t_b),
    computed as ratios to m so that large exponents do not overflow."""
    m = np.minimum(t_a, t_b)
    return ((g_a + 1) * (g_b + 1) / (g_a + g_b + 1) * (m / t_a) ** (g_a + 1) * (m / t_b) ** (g_b + 1) / m)


def reconstruction_weights(snapshot_steps: Sequence[int], snapshot_stds: Sequence[float], target_step: int,
                           target_std: float) -> np.ndarray:
    """The weights x (one per snapshot, summing to 1) of the snapshots' combination whose profile is
    closest to the target's: A x = b with A the snapshots' inner products and b theirs with the target."""
    t = np.asarray(snapshot_steps, dtype=np.float64)
    g = np.array([exponent_of_std(s) for s in snapshot_stds])
    gram = profile_inner_product(t[:, None], g[:, None], t[None, :], g[None, :])
    target = profile_inner_product(t, g, np.float64(target_step), np.float64(exponent_of_std(target_std)))
    x = np.linalg.solve(gram, target)
    return x / x.sum()
