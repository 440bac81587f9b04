"""Python entry points: sample a batch from a DiT in memory (sample.py, the trainer's grids, the
benchmarks). `plan_sampling` checks the sampling settings once (sampler against the objective, steps,
guidance against the model, precision), then samples any number of batches; `sample_latents` /
`sample_images` are the one-call forms."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..diffusion import SAMPLERS, Objective, SDEOptions, build_objective, check_time_shift, resolve_sampler
from ..errors import UserError
from .decode import Decoder, decode_pixels
from .guidance import Guidance, GuidedDenoiser
from .noise import SampleNoise, check_classes

ObjectiveLike = Objective | Mapping[str, Any]  # an objective, or a spec such as a checkpoint's spec["diffusion"]


@dataclass
class SamplingPlan:
    """A checked sampler setup around one network; `latents` samples a batch without further checks."""

    objective: Objective
    sampler: str
    steps: int
    denoiser: GuidedDenoiser
    sde: SDEOptions
    time_shift: float = 1.0

    def latents(self, labels: torch.Tensor, indices: Sequence[int] | np.ndarray, seed: int) -> torch.Tensor:
        """x_0 (N, C, H, W) float32; sample j uses the random streams of (seed, indices[j])."""
        net = self.denoiser.model
        device = next(net.parameters()).device
        noise = SampleNoise(seed, indices, (net.in_channels, net.input_size, net.input_size), device)
        was_training = net.training
        net.eval()  # no label dropout while sampling
        entry = SAMPLERS[self.sampler]
        shift = {"time_shift": self.time_shift} if entry.shifts_time else {}
        try:
            return entry.run(self.objective, self.denoiser, noise.next(), labels.to(device), noise,
                             steps=self.steps, sde=self.sde, **shift)
        finally:
            net.train(was_training)


def plan_sampling(model: torch.nn.Module, objective: ObjectiveLike, *, sampler: str | None = None,
                  steps: int | None = None, guidance: Guidance = Guidance(), precision: str = "fp32",
                  sde: SDEOptions = SDEOptions(), time_shift: float = 1.0, compile: bool = False,
                  names: tuple[str, str, str] = ("sampler", "steps", "time_shift"),
                  guide: torch.nn.Module | None = None) -> SamplingPlan:
    """Checks the settings once; sampler and steps default to the objective's (DDPM: ddpm-250; flow:
    heun-25), and errors call sampler, steps and time shift `names` (sample.py: its flags). `compile`:
    torch.compile the network with static shapes (feed it batches of one size). `guide`:
    autoguidance's weak model."""
    objective = build_objective(objective)
    sampler, steps = resolve_sampler(objective, sampler, steps, names[:2])
    check_time_shift(sampler, time_shift, names[2])
    denoiser = GuidedDenoiser(model, guidance, precision, objective.normalized_time, compile=compile, guide=guide)
    return SamplingPlan(objective, sampler, steps, denoiser, sde, float(time_shift))


def sample_latents(model: torch.nn.Module, objective: ObjectiveLike, labels: Sequence[int] | np.ndarray | torch.Tensor,
                   *, indices: Sequence[int] | np.ndarray | None = None, seed: int = 0, **settings) -> torch.Tensor:
    """x_0 (N, C, H, W) float32 for the given labels; sample j uses the random streams of (seed, indices[j])
    (indices default to 0..N-1), so it does not depend on its batch (dopri5 excepted: its steps adapt
    to the whole batch). `settings`: `plan_sampling`'s (sampler, steps, guidance, precision, ...)."""
    plan = plan_sampling(model, objective, **settings)
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 1 or len(labels) == 0:
        raise UserError("labels must be a non-empty 1-D list of class ids")
    check_classes(labels.unique().tolist(), plan.denoiser.num_classes)
    indices = np.arange(len(labels)) if indices is None else np.asarray(indices)
    if len(indices) != len(labels):
        raise ValueError(f"{len(indices)} indices for {len(labels)} labels")
    return plan.latents(labels, indices, seed)


def sample_images(model: torch.nn.Module, objective: ObjectiveLike, labels: Sequence[int] | np.ndarray | torch.Tensor,
                  *, decoder: Decoder | None = None, **kwargs: Any) -> np.ndarray:
    """uint8 (N, H, W, C) images, keyword arguments as for `sample_latents`; `decoder` defaults to the
    pixel-space rescale, latent models pass `build_decoder(...)`."""
    return (decoder or decode_pixels)(sample_latents(model, objective, labels, **kwargs))
