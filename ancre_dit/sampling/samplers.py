"""The reverse-process loops: DDPM (ADM/DiT's ancestral sampler with learned variance, respaced to
K steps, no clipping) and diffusers' DDIM / DPM-Solver++ on epsilon.

All three start from the samples' own initial noise; only DDPM draws fresh noise per step, again
from each sample's own generator (see noise.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UserError
from ..diffusion.gaussian import GaussianDiffusion, create_diffusion, diffusers_scheduler
from .noise import SampleNoise

SAMPLERS = ("ddpm", "ddim", "dpm-solver")
Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def schedule_kwargs(diffusion_spec: dict[str, Any]) -> dict[str, Any]:
    return dict(num_timesteps=int(diffusion_spec.get("num_timesteps", 1000)),
                beta_start=float(diffusion_spec.get("beta_start", 1e-4)),
                beta_end=float(diffusion_spec.get("beta_end", 0.02)))


def check_steps(sampler: str, steps: int, num_timesteps: int) -> None:
    if sampler not in SAMPLERS:
        raise UserError(f"--sampler {sampler} is unknown; choose {', '.join(SAMPLERS)}")
    if not 1 <= int(steps) <= num_timesteps:
        raise UserError(f"--steps {steps} must be between 1 and the model's {num_timesteps} training timesteps")


def respaced_diffusion(diffusion_spec: dict[str, Any], steps: int) -> GaussianDiffusion:
    """DiT's schedule respaced ADM-style to `steps` steps (e.g. 250 of 1000)."""
    return create_diffusion(respacing=str(int(steps)), learn_sigma=bool(diffusion_spec.get("learn_sigma", True)),
                            **schedule_kwargs(diffusion_spec))


@torch.no_grad()
def ddpm_loop(denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor, noise: SampleNoise,
              diffusion: GaussianDiffusion) -> torch.Tensor:
    """Ancestral sampling x_T -> x_0 over the (respaced) diffusion; the model sees original timesteps."""
    for k in reversed(range(diffusion.num_timesteps)):
        t = torch.full((len(x),), k, device=x.device, dtype=torch.long)
        out = denoiser(x, diffusion.model_timesteps(t), y)
        # No noise is added at the last step, so none is drawn for it.
        step_noise = noise.next() if k > 0 else torch.zeros_like(x)
        x = diffusion.p_sample(out, x, t, step_noise)
    return x


@torch.no_grad()
def scheduler_loop(denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor, kind: str, steps: int,
                   diffusion_spec: dict[str, Any]) -> torch.Tensor:
    """DDIM (eta 0) or DPM-Solver++(2M) through diffusers; only epsilon (first C channels) is passed,
    since DPM-Solver's learned-variance mode assumes 3-channel images."""
    scheduler = diffusers_scheduler(kind, **schedule_kwargs(diffusion_spec))
    scheduler.set_timesteps(int(steps), device=x.device)
    channels = x.shape[1]
    x = x * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(x, t)
        out = denoiser(model_input, t.to(x.device, torch.long).expand(len(x)), y)
        x = scheduler.step(out[:, :channels], t, x).prev_sample
    return x


def run_sampler(denoiser: Denoiser, y: torch.Tensor, noise: SampleNoise, *, sampler: str, steps: int,
                diffusion_spec: dict[str, Any]) -> torch.Tensor:
    """Draws x_T from `noise` and runs `sampler` for `steps` steps -> x_0 (N, C, H, W) float32."""
    num_timesteps = schedule_kwargs(diffusion_spec)["num_timesteps"]
    check_steps(sampler, steps, num_timesteps)
    x = noise.next()
    if sampler == "ddpm":
        return ddpm_loop(denoiser, x, y, noise, respaced_diffusion(diffusion_spec, steps))
    return scheduler_loop(denoiser, x, y, sampler, steps, diffusion_spec)
