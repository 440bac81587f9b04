"""DiT's Gaussian diffusion: linear beta schedule, epsilon prediction, learned variance.

The tables are float64 like ADM / DiT (diffusers' float32 ones shift DDPM-250 samples slightly). The
learned variance, the hybrid loss and the respacing are written by hand: diffusers has no training loss,
and its respaced DDPM does not interpolate the learned variance over the respaced betas as DiT does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .base import mean_flat


# DiT's linear schedule: the one place these numbers live (model_spec.json copies them per run).
DDPM_SCHEDULE = {"num_timesteps": 1000, "beta_start": 1e-4, "beta_end": 0.02}


def linear_betas(num_timesteps: int = DDPM_SCHEDULE["num_timesteps"], beta_start: float = DDPM_SCHEDULE["beta_start"],
                 beta_end: float = DDPM_SCHEDULE["beta_end"]) -> np.ndarray:
    """DiT's schedule, scaled like ADM's `get_named_beta_schedule("linear")` for 1000 steps."""
    scale = 1000 / num_timesteps
    return np.linspace(scale * beta_start, scale * beta_end, num_timesteps, dtype=np.float64)


def space_timesteps(num_timesteps: int, count: int) -> list[int]:
    """ADM's respacing with one section: `count` evenly strided steps over [0, T) ("250" -> 250 of 1000);
    DDPMObjective.check_steps keeps `count` within T."""
    stride = 1 if count <= 1 else (num_timesteps - 1) / (count - 1)
    position, taken = 0.0, []
    for _ in range(count):
        taken.append(round(position))
        position += stride
    return sorted(set(taken))


# The hybrid loss's variational-bound term (Ho et al. 2020, Nichol & Dhariwal 2021); no library exposes it.
def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL( N(mean1, exp(logvar1)) || N(mean2, exp(logvar2)) ), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Fast tanh approximation of the standard normal CDF, as used by the improved-DDPM decoder."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """log-likelihood of data x in [-1, 1] quantised to 256 bins under N(means, exp(log_scales)^2); the
    outermost bins extend to -inf / +inf, so the edge values' likelihood is finite."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


@dataclass
class MeanVariance:
    mean: torch.Tensor
    variance: torch.Tensor
    log_variance: torch.Tensor


class GaussianDiffusion:
    """Forward process, posterior, model mean/variance and DiT's hybrid training loss. The model is
    always called with original timesteps (`timestep_map[k]` for respaced step k), so one network
    serves every respacing."""

    def __init__(self, betas: np.ndarray, learn_sigma: bool = True, timestep_map: list[int] | None = None):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or (betas <= 0).any() or (betas > 1).any():
            raise ValueError("betas must be a 1-D array in (0, 1]")
        self.betas = betas
        self.learn_sigma = learn_sigma
        self.num_timesteps = len(betas)
        self.timestep_map = np.asarray(timestep_map if timestep_map is not None else range(len(betas)))

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The posterior variance is 0 at t = 0; ADM clips its log to the value at t = 1.
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        # Fixed ("large") variance of DiT when learn_sigma is off.
        self.fixed_log_variance = np.log(np.append(self.posterior_variance[1], betas[1:]))
        self._tables: dict[tuple, torch.Tensor] = {}

    def _table(self, name: str, device: torch.device) -> torch.Tensor:
        """The numpy table `name` as a tensor on `device`, copied there once."""
        if (name, device) not in self._tables:
            self._tables[name, device] = torch.from_numpy(np.asarray(getattr(self, name))).to(device)
        return self._tables[name, device]

    def _extract(self, name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """Gathers table[t] (computed in float64, used in float32) shaped to broadcast over x."""
        return self._table(name, t.device)[t].float().reshape(-1, *([1] * (ndim - 1)))

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """Respaced indices -> the original timesteps the network was trained on."""
        return self._table("timestep_map", t.device)[t]

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps."""
        return (self._extract("sqrt_alphas_cumprod", t, x_start.ndim) * x_start
                + self._extract("sqrt_one_minus_alphas_cumprod", t, x_start.ndim) * noise)

    def q_posterior(self, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Mean and clipped log variance of q(x_{t-1} | x_t, x_0)."""
        mean = (self._extract("posterior_mean_coef1", t, x_t.ndim) * x_start
                + self._extract("posterior_mean_coef2", t, x_t.ndim) * x_t)
        return mean, self._extract("posterior_log_variance_clipped", t, x_t.ndim)

    def p_mean_variance(self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> MeanVariance:
        """p(x_{t-1} | x_t) from the network output (eps, and with learned sigma the variance
        interpolation v in [-1, 1] between beta_t and the clipped posterior variance)."""
        channels = x_t.shape[1]
        if self.learn_sigma:
            if model_output.shape[1] != 2 * channels:
                raise ValueError(f"learned sigma needs {2 * channels} output channels, got {model_output.shape[1]}")
            eps, var_values = model_output.float().split(channels, dim=1)
            min_log = self._extract("posterior_log_variance_clipped", t, x_t.ndim)
            max_log = torch.log(self._extract("betas", t, x_t.ndim))
            frac = (var_values + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
        else:
            eps = model_output[:, :channels].float()
            log_variance = self._extract("fixed_log_variance", t, x_t.ndim).expand_as(x_t)
        pred_xstart = (self._extract("sqrt_recip_alphas_cumprod", t, x_t.ndim) * x_t
                       - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.ndim) * eps)
        # No clipping of pred_xstart: DiT's latents are not bounded to [-1, 1].
        return MeanVariance(self.q_posterior(pred_xstart, x_t, t)[0], torch.exp(log_variance), log_variance)

    def vb_terms_bpd(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
        """Per-sample variational-bound term in bits per dim: KL(q || p) for t > 0, the
        discretized decoder NLL at t = 0."""
        true_mean, true_log_variance = self.q_posterior(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, out.mean, out.log_variance)) / np.log(2.0)
        nll = mean_flat(-discretized_gaussian_log_likelihood(x_start, out.mean, 0.5 * out.log_variance)) / np.log(2.0)
        return torch.where(t == 0, nll, kl)

    def training_losses(self, model: Callable[..., torch.Tensor], x_start: torch.Tensor, t: torch.Tensor,
                        model_kwargs: dict, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """DiT's loss per sample: MSE on epsilon, plus with learned sigma the VLB term computed
        with the predicted mean detached, so the VLB trains only the variance (improved DDPM)."""
        x_t = self.q_sample(x_start, t, noise)
        model_output = model(x_t, self.model_timesteps(t), **model_kwargs)
        channels = x_start.shape[1]
        eps = model_output[:, :channels].float()
        terms = {"mse": mean_flat((noise - eps) ** 2)}
        if self.learn_sigma:
            frozen = torch.cat([eps.detach(), model_output[:, channels:].float()], dim=1)
            terms["vb"] = self.vb_terms_bpd(frozen, x_start, x_t, t)
        terms["loss"] = terms["mse"] + terms["vb"] if self.learn_sigma else terms["mse"]
        return terms


def create_diffusion(respacing: str | int | None = None, learn_sigma: bool = True,
                     **schedule: Any) -> GaussianDiffusion:
    """DiT's linear schedule (DDPM_SCHEDULE, or num_timesteps / beta_start / beta_end given),
    optionally respaced (e.g. "250" for sampling)."""
    betas = linear_betas(**schedule)
    if respacing in (None, "", len(betas), str(len(betas))):
        return GaussianDiffusion(betas, learn_sigma)
    # ADM's respacing: the kept steps' betas are chosen to keep their alphas_cumprod.
    use = space_timesteps(len(betas), int(respacing))
    alphas_cumprod = np.cumprod(1.0 - betas)[use]
    return GaussianDiffusion(1.0 - alphas_cumprod / np.append(1.0, alphas_cumprod[:-1]), learn_sigma, use)

