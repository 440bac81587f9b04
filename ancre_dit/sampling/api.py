"""Python entry points: sample a batch from a DiT in memory (sample.py, the trainer's grids, the
benchmarks). `plan_sampling` checks the settings once (sampler against the objective, steps, guidance
against the model, precision), then samples any number of batches; `sample_latents` / `sample_images`
are the one-call forms.

Sample i depends only on (seed, i), not on the batch size, the process count or its batch: it owns a
CPU torch.Generator seeded from (seed, i) that draws its initial noise and every per-step noise in a
fixed order, and its label is balanced (default), drawn from its own label stream, or taken from a
user list cycled. Latent models decode through their VAE (ancre_dit.vae), pixel-space models (digits)
by a plain rescale."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..data.adm_npz import to_uint8
from ..diffusion import SAMPLERS, Objective, SDEOptions, build_objective, check_time_shift, resolve_sampler
from ..errors import UserError
from ..vae import decode_to_uint8, load_run_vae
from .guidance import Guidance, GuidedDenoiser

# Stream ids, so that labels and noise drawn for the same (seed, i) are independent.
NOISE_STREAM = 0
LABEL_STREAM = 1


def sample_seed(seed: int, index: int, stream: int = NOISE_STREAM) -> int:
    """A well-mixed 63-bit seed for sample `index` of a job seeded `seed` (SeedSequence hashing,
    not seed + index, so that neighbouring jobs do not share streams)."""
    state = np.random.SeedSequence([int(seed), int(index), int(stream)]).generate_state(1, np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


class SampleNoise:
    """Standard normal noise of shape `shape` per sample, one generator per sample index."""

    def __init__(self, seed: int, indices: Sequence[int], shape: Sequence[int], device: torch.device | str = "cpu"):
        self.shape = tuple(int(s) for s in shape)
        self.device = torch.device(device)
        self.generators = [torch.Generator(device="cpu").manual_seed(sample_seed(seed, int(i))) for i in indices]

    def next(self) -> torch.Tensor:
        """The next draw of every sample, stacked: (N, *shape) float32 on `device`; drawn on the CPU
        (cheap next to a network forward) so that a sample is identical on any device."""
        return torch.stack([torch.randn(self.shape, generator=g) for g in self.generators]).to(self.device)


def check_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    """The user's class ids as ints, each checked against the model's class count."""
    if not classes:
        raise UserError("--classes is empty; give class ids such as --classes 1,2,3")
    bad = [c for c in classes if not 0 <= int(c) < num_classes]
    if bad:
        raise UserError(f"class id(s) {', '.join(map(str, bad))} out of range: this model has {num_classes} "
                        f"classes, ids 0..{num_classes - 1}")
    return [int(c) for c in classes]


def assign_labels(indices: Sequence[int] | np.ndarray, num_classes: int, *, seed: int = 0, mode: str = "balanced",
                  classes: Sequence[int] | None = None) -> np.ndarray:
    """int64 labels of the given sample indices: classes[i % len(classes)] when classes are given
    (checked by the caller); else "balanced", class i % num_classes (N = 50 x num_classes gives exactly
    50 per class, any prefix is balanced to within one), or "random", uniform from i's label stream."""
    indices = np.asarray(indices, dtype=np.int64)
    if classes is not None:
        table = np.asarray(classes, dtype=np.int64)
        return table[indices % len(table)]
    if mode == "balanced":
        return indices % num_classes
    if mode == "random":
        return np.array([np.random.default_rng(sample_seed(seed, i, LABEL_STREAM)).integers(num_classes)
                         for i in indices], dtype=np.int64)
    raise UserError(f"unknown label mode {mode!r}; choose balanced or random")


Decoder = Callable[[torch.Tensor], np.ndarray]


def decode_pixels(x: torch.Tensor) -> np.ndarray:
    """A pixel-space sample (N, C, H, W) in [-1, 1] -> uint8 (N, H, W, C), clipped and rounded to nearest."""
    return to_uint8(x).transpose(0, 2, 3, 1)


def build_decoder(data_spec: dict[str, Any], model_channels: int, vae: str | None = None,
                  device: torch.device | str = "cpu") -> Decoder:
    """The decoder a checkpoint needs: its run's VAE (or `vae`, a local folder that overrides it) for
    latent models; none for pixel-space models."""
    kind = data_spec.get("kind")
    if kind != "latents":
        if vae:
            raise UserError(f"--vae given, but this checkpoint is a pixel-space ({kind}) model that needs no VAE; "
                            "drop --vae")
        return decode_pixels
    return partial(decode_to_uint8, load_run_vae(data_spec, model_channels, vae, device))


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
    """Checks the settings once; sampler and steps default to the objective's (DDPM: ddpm-250; flow: heun-25),
    errors call sampler, steps and time shift `names` (sample.py: its flags). `compile`: torch.compile the
    network with static shapes (feed it batches of one size). `guide`: autoguidance's weak model."""
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
