"""Flow matching with SiT's interpolants and predictions (Ma et al., 2024), in SiT's conventions so
that SiT's weights sample correctly here: x_t = alpha(t) x1 + sigma(t) x0, x1 the data, x0 ~ N(0, I),
t = 0 noise and t = 1 data, on the linear, GVP or VP path (paths.py); t enters the timestep embedding
as a float in [0, 1]. The network predicts the velocity alpha' x1 + sigma' x0 (plain MSE: SiT ignores a
loss weight there, so one is refused), the score or the noise x0 (SiT's weights: none, "velocity"
(b / sigma)^2 or "likelihood" b / sigma^2, b the score's coefficient in the probability-flow drift).
Training times lie in SiT's interval, uniform (SiT) or logit-normal sigmoid(m + s n), n ~ N(0, 1)
(SD3 / LightningDiT), scaled onto it as LightningDiT does. LightningDiT's cosine loss 1 - cos(v_pred, v)
over the channels may be added to the MSE with a weight. Normalised time (guidance's unit) is u = 1 - t.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UserError
from .base import Draws, Objective, mean_flat
from .paths import LOSS_WEIGHTS, PATHS, PREDICTIONS

TIME_SAMPLINGS = ("uniform", "logit-normal")


def _like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (x.ndim - 1))).to(x.dtype)


class FlowObjective(Objective):
    """Flow matching on one of SiT's paths; loss terms "mse", with a cosine weight "cos", and "loss"."""

    name = "flow"
    default_sampler = "heun"

    def __init__(self, time_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 cosine_loss_weight: float = 0.0, path: str = "linear", prediction: str = "velocity",
                 loss_weight: str = "none"):
        for key, value, choices in (("time_sampling", time_sampling, TIME_SAMPLINGS), ("path", path, PATHS),
                                    ("prediction", prediction, PREDICTIONS), ("loss_weight", loss_weight, LOSS_WEIGHTS)):
            if value not in choices:
                raise UserError(f"unknown diffusion.{key} {value!r}; choose {' or '.join(choices)}")
        if not float(logit_std) > 0:
            raise UserError(f"diffusion.logit_std must be positive, got {logit_std}")
        if prediction == "velocity" and loss_weight != "none":
            raise UserError(f"diffusion.loss_weight={loss_weight} weighs a score or noise prediction (SiT ignores it "
                            "for a velocity); set diffusion.prediction or drop the weight")
        if cosine_loss_weight and prediction != "velocity":
            raise UserError("diffusion.cosine_loss_weight is LightningDiT's loss on a predicted velocity; with "
                            f"diffusion.prediction={prediction} set it to 0")
        self.time_sampling, self.prediction, self.loss_weight = time_sampling, prediction, loss_weight
        self.path = PATHS[path]
        self.logit_mean, self.logit_std = float(logit_mean), float(logit_std)
        self.cosine_loss_weight = float(cosine_loss_weight)
        self.training_interval = self.path.interval(prediction, training=True)

    def spec(self) -> dict[str, Any]:
        spec = {"objective": self.name, "path": self.path.name, "prediction": self.prediction,
                "time_sampling": self.time_sampling, "logit_mean": self.logit_mean, "logit_std": self.logit_std,
                "learn_sigma": False}
        # Only when set: the specs of runs without them stay as they were (resume).
        if self.loss_weight != "none":
            spec["loss_weight"] = self.loss_weight
        if self.cosine_loss_weight:
            spec["cosine_loss_weight"] = self.cosine_loss_weight
        return spec

    def interpolate(self, data: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_t, u_t): the point at time t between noise (t = 0) and data (t = 1) and its velocity."""
        alpha, d_alpha, sigma, d_sigma = self.path.coefficients(_like(t, data))
        return alpha * data + sigma * noise, d_alpha * data + d_sigma * noise

    def draw(self, x: torch.Tensor, generator: torch.Generator) -> Draws:
        g = generator
        if self.time_sampling == "uniform":
            t = torch.rand(x.shape[0], generator=g, device=g.device)
        else:
            t = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(x.shape[0], generator=g, device=g.device))
        t0, t1 = self.training_interval
        if (t0, t1) != (0.0, 1.0):  # SiT's intervals; the linear path's [0, 1] costs no op in the step
            t = t * (t1 - t0) + t0
        noise = torch.randn(x.shape, generator=g, device=g.device, dtype=x.dtype)
        return t.to(x.device), noise.to(x.device)

    def losses(self, model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               draws: Draws) -> dict[str, torch.Tensor]:
        t, noise = draws
        x_t, target = self.interpolate(x, noise, t)
        out = model(x_t, t, y=y)[:, : x.shape[1]].float()
        if self.prediction != "velocity":
            return {"mse": (mse := self._weighted_error(out, noise.float(), _like(t, out))), "loss": mse}
        mse = mean_flat((out - target.float()) ** 2)
        if not self.cosine_loss_weight:
            return {"mse": mse, "loss": mse}
        cos = mean_flat(1 - torch.nn.functional.cosine_similarity(out, target.float(), dim=1))
        return {"mse": mse, "cos": cos, "loss": mse + self.cosine_loss_weight * cos}

    def _weighted_error(self, out: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """SiT's loss for a noise or score prediction: weight * (out - x0)^2 or weight * (out sigma + x0)^2."""
        sigma = self.path.coefficients(t)[2]
        if self.loss_weight == "none":
            weight = 1.0
        else:
            b = self.path.drift_terms(t)[1]
            weight = (b / sigma) ** 2 if self.loss_weight == "velocity" else b / sigma ** 2
        error = out - noise if self.prediction == "noise" else out * sigma + noise
        return mean_flat(weight * error ** 2)

    # -- what the samplers ask of a network output `out` at (x, t); t of shape (N,) -------------------
    def sampling_interval(self, sde: bool = False, last_step_size: float = 0.0) -> tuple[float, float]:
        return self.path.interval(self.prediction, sde=sde, last_step_size=last_step_size)

    def score(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tt = _like(t, x)
        if self.prediction == "score":
            return out
        if self.prediction == "noise":
            return out / -self.path.coefficients(tt)[2]
        return self.path.score_from_velocity(out, x, tt)

    def velocity(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The probability-flow ODE's drift dx/dt (SiT's get_drift)."""
        if self.prediction == "velocity":
            return out
        a, b = self.path.drift_terms(_like(t, x))
        return a * x + b * self.score(out, x, t)

    def diffusion(self, t: float, norm: float) -> float:
        """SiT's default SDE diffusion coefficient ("sigma" form): w(t) = norm * sigma(t)."""
        return norm * float(self.path.coefficients(torch.tensor(t, dtype=torch.float64))[2])

    def diffusion_times_score(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor, norm: float) -> torch.Tensor:
        """w(t) * score; on the linear path with a velocity the (1 - t) cancels, so it stays finite at any t."""
        if self.path.name == "linear" and self.prediction == "velocity":
            return norm * (_like(t, x) * out - x)
        return norm * self.path.coefficients(_like(t, x))[2] * self.score(out, x, t)

    def tweedie(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """E[data | x_t] = x / alpha + sigma^2 / alpha * score (SiT's "Tweedie" last step)."""
        alpha, _, sigma, _ = self.path.coefficients(_like(t, x))
        return x / alpha + sigma ** 2 / alpha * self.score(out, x, t)

    def normalized_time(self, t: float) -> float:
        return 1.0 - float(t)

    def times_at(self, u: float, count: int) -> torch.Tensor:
        return torch.full((count,), 1.0 - float(u))

    def evaluation_times(self, count: int) -> torch.Tensor:
        t0, t1 = self.training_interval
        return t0 + (t1 - t0) * (torch.arange(count, dtype=torch.float32) + 0.5) / count
