"""DiT's objective (DDPM): epsilon prediction on the linear 1000-step schedule, learned variance
trained with the VLB term, sampled with ADM's ancestral sampler (respaced) or diffusers' DDIM /
DPM-Solver++. The model is called with the original integer timesteps 0..T-1 (T-1 = noise)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..errors import UserError
from .base import Denoiser, Draws, NoiseSource, Objective, SDEOptions
from .gaussian import DDPM_SCHEDULE, GaussianDiffusion, create_diffusion


def schedule_of(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The schedule a spec names (DiT's where it names none), each value of the type of DiT's."""
    return {key: type(default)(spec.get(key, default)) for key, default in DDPM_SCHEDULE.items()}


def respaced_diffusion(spec: Mapping[str, Any], steps: int) -> GaussianDiffusion:
    """DiT's schedule respaced ADM-style to `steps` steps (e.g. 250 of 1000)."""
    return create_diffusion(respacing=str(int(steps)), learn_sigma=bool(spec.get("learn_sigma", True)),
                            **schedule_of(spec))


@torch.no_grad()
def ddpm_sampler(objective: "DDPMObjective", denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor,
                 noise: NoiseSource, *, steps: int, sde: SDEOptions) -> torch.Tensor:
    """The sampler table's "ddpm": ADM's ancestral sampling x_T -> x_0 on the schedule respaced to
    `steps`; the model sees the original timesteps."""
    diffusion = respaced_diffusion(objective.spec(), steps)
    for k in reversed(range(diffusion.num_timesteps)):
        t = torch.full((len(x),), k, device=x.device, dtype=torch.long)
        out = diffusion.p_mean_variance(denoiser(x, diffusion.model_timesteps(t), y), x, t)
        # No noise is added at the last step, so none is drawn for it.
        x = out.mean + torch.exp(0.5 * out.log_variance) * noise.next() if k > 0 else out.mean
    return x


@torch.no_grad()
def scheduler_sampler(objective: "DDPMObjective", denoiser: Denoiser, x: torch.Tensor, y: torch.Tensor,
                      noise: NoiseSource, *, steps: int, sde: SDEOptions, kind: str) -> torch.Tensor:
    """The sampler table's "ddim" (eta 0, no noise drawn) and "dpm-solver" (DPM-Solver++(2M)) through
    diffusers, clipping and thresholding off (DiT's latents are not bounded to [-1, 1]); only epsilon
    (first C channels) is passed, since DPM-Solver's learned-variance mode assumes 3-channel images."""
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

    schedule = objective.schedule
    common = dict(num_train_timesteps=schedule["num_timesteps"], beta_start=schedule["beta_start"],
                  beta_end=schedule["beta_end"], beta_schedule="linear", prediction_type="epsilon")
    if kind == "ddim":
        scheduler = DDIMScheduler(**common, clip_sample=False, set_alpha_to_one=True, timestep_spacing="leading")
    else:
        scheduler = DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2,
                                                thresholding=False, lower_order_final=True)
    scheduler.set_timesteps(int(steps), device=x.device)
    x = x * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        out = denoiser(scheduler.scale_model_input(x, t), t.to(x.device, torch.long).expand(len(x)), y)
        x = scheduler.step(out[:, :x.shape[1]], t, x).prev_sample
    return x


class DDPMObjective(Objective):
    """DiT's diffusion objective, unchanged: losses "mse" (epsilon), "vb" (learned sigma) and "loss"."""

    name = "ddpm"
    default_sampler = "ddpm"

    def __init__(self, learn_sigma: bool = True, **schedule: Any):
        self.learn_sigma = bool(learn_sigma)
        self.schedule = schedule_of(schedule)
        self.diffusion = create_diffusion(learn_sigma=self.learn_sigma, **self.schedule)
        self.num_timesteps = self.schedule["num_timesteps"]

    def spec(self) -> dict[str, Any]:
        return {"objective": self.name, **self.schedule, "learn_sigma": self.learn_sigma}

    def draw(self, x: torch.Tensor, generator: torch.Generator) -> Draws:
        g = generator
        t = torch.randint(0, self.num_timesteps, (x.shape[0],), generator=g, device=g.device).to(x.device)
        noise = torch.randn(x.shape, generator=g, device=g.device, dtype=x.dtype).to(x.device)
        return t, noise

    def losses(self, model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               draws: Draws) -> dict[str, torch.Tensor]:
        t, noise = draws
        return self.diffusion.training_losses(model, x, t, model_kwargs={"y": y}, noise=noise)

    def normalized_time(self, t: float) -> float:
        return float(t) / (self.num_timesteps - 1)

    def times_at(self, u: float, count: int) -> torch.Tensor:
        return torch.full((count,), round(float(u) * (self.num_timesteps - 1)), dtype=torch.long)

    def evaluation_times(self, count: int) -> torch.Tensor:
        # Bin centres: 50, 150, ..., 950 for 10 of 1000, spread over the whole process like the training loss.
        return torch.tensor([int((2 * k + 1) * self.num_timesteps / (2 * count)) for k in range(count)])

    def check_steps(self, steps: int, name: str = "steps") -> None:
        if not 1 <= int(steps) <= self.num_timesteps:
            raise UserError(f"{name} {steps} must be between 1 and the model's {self.num_timesteps} training timesteps")
