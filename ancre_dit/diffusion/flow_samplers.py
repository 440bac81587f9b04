"""Samplers of the linear-interpolant flow (time 0 = noise, 1 = data; see flow.py).

ODE dx/dt = v(x, t) through torchdiffeq: "euler" and "heun" (torchdiffeq's heun2, two network
calls per step) on `steps` equal intervals of [0, 1], "dopri5" adaptive with SiT's tolerances
(atol 1e-6, rtol 1e-3). Note that dopri5's step sizes adapt to the whole batch, so a dopri5
sample depends on the batch it is in (a fixed --batch-size still gives the same file whatever
the number of processes).

SDE: SiT's Euler-Maruyama written by hand (torchdiffeq has no SDE solver), with SiT's defaults:
time points linspace(0, 1 - last_step_size, steps), so steps - 1 noisy steps, then one last step
without noise; diffusion coefficient w(t) = norm * sigma_t = norm * (1 - t) ("sigma" form), drift
v + w * score with the score of the linear path, score = (t v - x) / (1 - t), and
x <- x + drift dt + sqrt(2 w dt) z. Last step over the remaining time: "mean" (drift, SiT's
default), "euler" (velocity only), "tweedie" (E[data | x_t] = x / t + (1 - t)^2 / t * score), or "none".
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import NoiseSource, SDEOptions

from ..errors import UserError

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DOPRI5_TOLERANCES = {"atol": 1e-6, "rtol": 1e-3}


@torch.no_grad()
def ode_sample(velocity: Velocity, x: torch.Tensor, *, method: str, steps: int) -> torch.Tensor:
    """Integrates dx/dt = velocity(x, t) from t = 0 to 1 with torchdiffeq's `method`: a fixed-grid
    one ("euler", "heun2", ...) on `steps` equal intervals, or "dopri5" (adaptive, `steps` unused)."""
    from torchdiffeq import odeint

    span = torch.tensor([0.0, 1.0], device=x.device)

    def field(t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return velocity(state, t.to(state.dtype).expand(len(state)))

    if method == "dopri5":
        return odeint(field, x, span, method="dopri5", **DOPRI5_TOLERANCES)[-1]
    grid = torch.linspace(0.0, 1.0, steps + 1, device=x.device)
    return odeint(field, x, span, method=method, options={"grid_constructor": lambda f, y0, t: grid})[-1]


def check_sde_steps(steps: int, name: str = "steps") -> None:
    """SiT counts time points: `steps` points give steps - 1 noisy steps, so at least 2."""
    if int(steps) < 2:
        raise UserError(f"{name} {steps}: the SDE sampler needs at least 2 (SiT counts time points, "
                        "steps - 1 Euler-Maruyama steps plus the last step)")


def _score_times_w(v: torch.Tensor, x: torch.Tensor, t: float, norm: float) -> torch.Tensor:
    """w(t) * score for w = norm * (1 - t): the (1 - t) cancels, so this stays finite at any t."""
    return norm * (t * v - x)


@torch.no_grad()
def sde_sample(velocity: Velocity, x: torch.Tensor, noise: NoiseSource, *, steps: int,
               options: SDEOptions = SDEOptions()) -> torch.Tensor:
    """SiT's Euler-Maruyama sampler: steps - 1 noisy steps over [0, 1 - last_step_size], then the last step."""
    size = 0.0 if options.last_step == "none" else options.last_step_size
    times = torch.linspace(0.0, 1.0 - size, steps)  # float32 time points, as SiT
    dt = float(times[1] - times[0])
    batch = len(x)
    for t in times[:-1].tolist():
        v = velocity(x, torch.full((batch,), t, device=x.device))
        drift = v + _score_times_w(v, x, t, options.diffusion_norm)
        w = options.diffusion_norm * (1.0 - t)
        x = x + drift * dt + (2.0 * w * dt) ** 0.5 * noise.next()
    if options.last_step == "none":
        return x
    t1 = float(times[-1])
    v = velocity(x, torch.full((batch,), t1, device=x.device))
    if options.last_step == "mean":
        return x + (v + _score_times_w(v, x, t1, options.diffusion_norm)) * size
    if options.last_step == "euler":
        return x + v * size
    score = (t1 * v - x) / (1.0 - t1)
    return x / t1 + (1.0 - t1) ** 2 / t1 * score  # tweedie
