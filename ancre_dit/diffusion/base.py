"""The training objective as one interface: what the trainer, the sampling job, the sample grids
and the benchmarks ask of DDPM or flow matching. An objective draws a micro-batch's training time and
noise from the generator it is handed (so a resumed run continues bitwise), returns the per-sample loss
terms ("loss" is minimised), names its default sampler and allowed step counts (the samplers are in
sampler_registry.py) and maps model time to normalised time u in [0, 1] (0 = data, 1 = noise), the
guidance interval's unit.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch

from ..errors import UserError

# net(x, t, y) -> output; t holds the objective's model times, the same for the whole batch.
Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Draws = tuple[torch.Tensor, torch.Tensor]  # (model time per sample, noise shaped like x)


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch: a per-sample loss."""
    return x.mean(dim=list(range(1, x.ndim)))


class NoiseSource(Protocol):
    """Per-sample noise (see sampling.api.SampleNoise): each call gives the next draw of every sample."""

    def next(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class SDEOptions:
    """SiT's Euler-Maruyama options. diffusion_norm scales SiT's default ("sigma") diffusion
    coefficient w(t) = norm * (1 - t); last_step: "mean" (SiT's default), "tweedie", "euler" or
    "none", taken over the last `last_step_size` of time (SiT's default 0.04)."""

    last_step: str = "mean"
    last_step_size: float = 0.04
    diffusion_norm: float = 1.0

    def __post_init__(self):
        if self.last_step not in LAST_STEPS:
            raise UserError(f"--sde-last-step {self.last_step} is unknown; choose {', '.join(LAST_STEPS)}")
        if self.last_step != "none" and not 0 < self.last_step_size < 1:
            raise UserError(f"--sde-last-step-size {self.last_step_size} must be in (0, 1)")
        if not self.diffusion_norm >= 0:
            raise UserError(f"--sde-diffusion-norm {self.diffusion_norm} must be >= 0")


LAST_STEPS = ("mean", "tweedie", "euler", "none")


class Objective(ABC):
    """See the module docstring; subclasses set name and default_sampler."""

    name: ClassVar[str]
    default_sampler: ClassVar[str]

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """What model_spec.json records under "diffusion"; build_objective(spec) rebuilds this object."""

    @abstractmethod
    def draw(self, x: torch.Tensor, generator: torch.Generator) -> Draws:
        """Training time and noise for the micro-batch x, drawn from `generator` only."""

    @abstractmethod
    def losses(self, model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               draws: Draws) -> dict[str, torch.Tensor]:
        """Per-sample loss terms (N,) for data x, labels y and the given draws; "loss" is minimised."""

    @abstractmethod
    def normalized_time(self, t: float) -> float:
        """Model time -> u in [0, 1], 0 = data, 1 = pure noise."""

    @abstractmethod
    def times_at(self, u: float, count: int) -> torch.Tensor:
        """`count` copies of the model time at normalised time u (0 = data, 1 = noise)."""

    @abstractmethod
    def evaluation_times(self, count: int) -> torch.Tensor:
        """`count` model times spread evenly over the process (fixed held-out scores)."""

    def check_steps(self, steps: int, name: str = "steps") -> None:
        """A UserError naming `name` (a flag, a config key) if the schedule has no room for `steps` steps."""
        if int(steps) < 1:
            raise UserError(f"{name} {steps} must be at least 1")
