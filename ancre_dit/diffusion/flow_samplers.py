"""Samplers of the flow objective (time 0 = noise, 1 = data; see flow.py) on any of SiT's paths and
predictions: the objective turns the network's output into the ODE's drift, the score and the last
step, over SiT's interval for the path and prediction.

ODE dx/dt = v(x, t) through torchdiffeq: "euler" and "heun" (heun2, two network calls a step) on
`steps` intervals of an equal grid, or with a time shift s LightningDiT's t' = s t / (1 + (s - 1) t)
of it (s < 1 spends more steps near the noise; SD3's shift k is s = 1 / k); "dopri5" adaptive with
SiT's tolerances (its steps adapt to the whole batch, so a sample depends on its batch).

SDE: SiT's Euler-Maruyama by hand (torchdiffeq has none) with SiT's defaults: time points
linspace(t0, 1 - last_step_size, steps), steps - 1 noisy steps x <- x + drift dt + sqrt(2 w dt) z with
w(t) = norm * sigma(t) and drift v + w * score, then one noiseless last step: "mean" (drift, SiT's
default), "euler" (velocity only), "tweedie" (E[data | x_t]) or "none".
"""
from __future__ import annotations

import torch

from .base import Denoiser, NoiseSource, Objective, SDEOptions


def shifted_times(t: torch.Tensor, shift: float) -> torch.Tensor:
    """LightningDiT's timestep shift of flow times t (0 = noise, 1 = data); 1 leaves them as they are."""
    return t if shift == 1 else shift * t / (1 + (shift - 1) * t)


@torch.no_grad()
def ode_sampler(objective: Objective, denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor, noise: NoiseSource,
                *, steps: int, sde: SDEOptions, method: str, time_shift: float = 1.0) -> torch.Tensor:
    """The sampler table's ODE entries: torchdiffeq's `method` from noise (t = 0) to data (t = 1), a
    fixed-grid one ("euler", "heun2") on `steps` intervals of the shifted grid, or "dopri5" (adaptive,
    `steps` and the shift unused)."""
    from torchdiffeq import odeint

    channels = x.shape[1]
    t0, t1 = objective.sampling_interval()
    span = torch.tensor([t0, t1], device=x.device)

    def field(t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        times = t.to(state.dtype).expand(len(state))
        return objective.velocity(denoiser(state, times, y)[:, :channels], state, times)

    if method == "dopri5":
        return odeint(field, x, span, method="dopri5", atol=1e-6, rtol=1e-3)[-1]  # SiT's tolerances
    grid = shifted_times(torch.linspace(t0, t1, int(steps) + 1, device=x.device), time_shift)
    return odeint(field, x, span, method=method, options={"grid_constructor": lambda f, y0, t: grid})[-1]


@torch.no_grad()
def sde_sampler(objective: Objective, denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor, noise: NoiseSource,
                *, steps: int, sde: SDEOptions) -> torch.Tensor:
    """The sampler table's "sde": SiT's Euler-Maruyama (see the module docstring)."""
    channels, norm = x.shape[1], sde.diffusion_norm

    def output(state: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        times = torch.full((len(state),), t, device=state.device)
        return denoiser(state, times, y)[:, :channels], times

    size = 0.0 if sde.last_step == "none" else sde.last_step_size
    t0, t1 = objective.sampling_interval(sde=True, last_step_size=size)
    times = torch.linspace(t0, t1, int(steps))  # float32 time points, as SiT
    dt = float(times[1] - times[0])
    for t in times[:-1].tolist():
        out, tt = output(x, t)
        drift = objective.velocity(out, x, tt) + objective.diffusion_times_score(out, x, tt, norm)
        x = x + drift * dt + (2.0 * objective.diffusion(t, norm) * dt) ** 0.5 * noise.next()
    if sde.last_step == "none":
        return x
    out, tt = output(x, float(times[-1]))
    if sde.last_step == "mean":
        return x + (objective.velocity(out, x, tt) + objective.diffusion_times_score(out, x, tt, norm)) * size
    if sde.last_step == "euler":
        return x + objective.velocity(out, x, tt) * size
    return objective.tweedie(out, x, tt)
