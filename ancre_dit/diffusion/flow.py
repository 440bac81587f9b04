"""Flow matching with SiT's linear interpolant and velocity prediction (Ma et al., 2024).

SiT's conventions (`transport/`: path.ICPlan, Transport, Sampler), so that SiT's weights sample
correctly here: x_t = t * x1 + (1 - t) * x0, x1 the data, x0 standard normal noise, so t = 0 is noise
and t = 1 data; the network predicts the velocity x1 - x0, trained with the plain MSE (SiT's
loss_weight None, learn_sigma off); t enters the timestep embedding as it is, a float in [0, 1];
sampling integrates dx/dt = v(x, t) over all of [0, 1] (SiT's train_eps and sample_eps are 0 here).
Training time is uniform (SiT) or logit-normal, t = sigmoid(m + s * n), n ~ N(0, 1) (SD3 /
LightningDiT). LightningDiT also adds a cosine loss on the velocity, 1 - cos(v_pred, v) over the
channels at each position, beside the MSE (here with a weight; 0 = off). Normalised time, the guidance
interval's unit, is u = 1 - t.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UserError
from .base import Draws, Objective
from .vlb import mean_flat

TIME_SAMPLINGS = ("uniform", "logit-normal")


class FlowObjective(Objective):
    """Linear-interpolant flow matching; loss terms "mse", with a cosine weight "cos", and "loss"."""

    name = "flow"
    default_sampler = "heun"

    def __init__(self, time_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 cosine_loss_weight: float = 0.0):
        if time_sampling not in TIME_SAMPLINGS:
            raise UserError(f"unknown diffusion.time_sampling {time_sampling!r}; choose {' or '.join(TIME_SAMPLINGS)}")
        if not logit_std > 0:
            raise UserError(f"diffusion.logit_std must be positive, got {logit_std}")
        self.time_sampling = time_sampling
        self.logit_mean, self.logit_std = float(logit_mean), float(logit_std)
        self.cosine_loss_weight = float(cosine_loss_weight)

    def spec(self) -> dict[str, Any]:
        spec = {"objective": self.name, "path": "linear", "prediction": "velocity", "time_sampling": self.time_sampling,
                "logit_mean": self.logit_mean, "logit_std": self.logit_std, "learn_sigma": False}
        if self.cosine_loss_weight:  # only then: the specs of runs without it stay as they were (resume)
            spec["cosine_loss_weight"] = self.cosine_loss_weight
        return spec

    @staticmethod
    def interpolate(data: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_t, u_t): the point at time t between noise (t = 0) and data (t = 1) and its velocity."""
        tt = t.reshape(-1, *([1] * (data.ndim - 1))).to(data.dtype)
        return tt * data + (1 - tt) * noise, data - noise

    def draw(self, x: torch.Tensor, generator: torch.Generator) -> Draws:
        g = generator
        if self.time_sampling == "uniform":
            t = torch.rand(x.shape[0], generator=g, device=g.device)
        else:
            t = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(x.shape[0], generator=g, device=g.device))
        noise = torch.randn(x.shape, generator=g, device=g.device, dtype=x.dtype)
        return t.to(x.device), noise.to(x.device)

    def losses(self, model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               draws: Draws) -> dict[str, torch.Tensor]:
        t, noise = draws
        x_t, target = self.interpolate(x, noise, t)
        velocity = model(x_t, t, y=y)[:, : x.shape[1]].float()
        mse = mean_flat((velocity - target.float()) ** 2)
        if not self.cosine_loss_weight:
            return {"mse": mse, "loss": mse}
        cos = mean_flat(1 - torch.nn.functional.cosine_similarity(velocity, target.float(), dim=1))
        return {"mse": mse, "cos": cos, "loss": mse + self.cosine_loss_weight * cos}

    def normalized_time(self, t: float) -> float:
        return 1.0 - float(t)

    def times_at(self, u: float, count: int) -> torch.Tensor:
        return torch.full((count,), 1.0 - float(u))

    def evaluation_times(self, count: int) -> torch.Tensor:
        return (torch.arange(count, dtype=torch.float32) + 0.5) / count
