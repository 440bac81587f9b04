"""SiT's interpolants (Ma et al., 2024; `transport/path.py`: ICPlan, GVPCPlan, VPCPlan), written
from their formulas: x_t = alpha(t) x1 + sigma(t) x0 with x1 the data, x0 ~ N(0, I), t = 0 noise
and t = 1 data, and the velocity u_t = alpha'(t) x1 + sigma'(t) x0.

- linear: alpha = t, sigma = 1 - t;
- gvp (REPA's cosine path on SiT's time axis): alpha = sin(pi t / 2), sigma = cos(pi t / 2);
- vp: alpha = exp(m(t)), sigma = sqrt(1 - alpha^2), m(t) = -(1 - t)^2 (b_max - b_min) / 4 - (1 - t) b_min / 2
  with b_min 0.1, b_max 20 (SiT's defaults).

What the samplers need besides: the probability-flow drift of a score, drift = a(t) x + b(t) score
(SiT's compute_drift: a = alpha' / alpha, b = a sigma^2 - sigma sigma'; VP: a = beta / 2 = b), and the
score of a velocity, score = (alpha / alpha' v - x) / (sigma^2 - alpha / alpha' sigma' sigma).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Coefficients = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # alpha, alpha', sigma, sigma'


def _linear(t: torch.Tensor) -> Coefficients:
    return t, torch.ones_like(t), 1 - t, -torch.ones_like(t)


def _gvp(t: torch.Tensor) -> Coefficients:
    half_pi = math.pi / 2
    return torch.sin(half_pi * t), half_pi * torch.cos(half_pi * t), torch.cos(half_pi * t), -half_pi * torch.sin(half_pi * t)


VP_BETA_MIN, VP_BETA_MAX = 0.1, 20.0
TRAIN_EPS, SAMPLE_EPS = 1e-5, 1e-3  # SiT's --train-eps and --sample-eps defaults (train_utils.py)


def _vp(t: torch.Tensor) -> Coefficients:
    s = 1 - t  # m = log alpha and its derivative dm
    m = -0.25 * s ** 2 * (VP_BETA_MAX - VP_BETA_MIN) - 0.5 * s * VP_BETA_MIN
    dm = 0.5 * s * (VP_BETA_MAX - VP_BETA_MIN) + 0.5 * VP_BETA_MIN
    alpha = torch.exp(m)
    sigma = torch.sqrt(1 - torch.exp(2 * m))
    return alpha, alpha * dm, sigma, -torch.exp(2 * m) * dm / sigma


@dataclass(frozen=True)
class Path:
    name: str
    coefficients: Callable[[torch.Tensor], Coefficients]

    def interval(self, prediction: str, *, training: bool = False, sde: bool = False,
                 last_step_size: float = 0.0) -> tuple[float, float]:
        """SiT's Transport.check_interval (with its default SDE diffusion form): the times [t0, t1]
        training draws from and sampling integrates over (an SDE's last step covers the rest)."""
        eps = TRAIN_EPS if training else SAMPLE_EPS
        end = 1 - last_step_size if sde and last_step_size > 0 else 1 - eps
        if self.name == "vp":
            return 0.0, end
        if prediction != "velocity":
            return eps, end
        return 0.0, end if sde else 1.0

    def drift_terms(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of the probability-flow drift a x + b score."""
        if self.name == "vp":  # SiT's VPCPlan.compute_drift: beta(t) / 2 for both
            beta = VP_BETA_MIN + (1 - t) * (VP_BETA_MAX - VP_BETA_MIN)
            return beta / 2, beta / 2
        alpha, d_alpha, sigma, d_sigma = self.coefficients(t)
        ratio = d_alpha / alpha
        return ratio, ratio * sigma ** 2 - sigma * d_sigma

    def score_from_velocity(self, v: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        alpha, d_alpha, sigma, d_sigma = self.coefficients(t)
        reverse_ratio = alpha / d_alpha
        return (reverse_ratio * v - x) / (sigma ** 2 - reverse_ratio * d_sigma * sigma)


PATHS: dict[str, Path] = {name: Path(name, f) for name, f in (("linear", _linear), ("gvp", _gvp), ("vp", _vp))}
PREDICTIONS = ("velocity", "score", "noise")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
