"""Python entry points: sample a batch from a DiT in memory (used by sample.py, the trainer's
grids and the benchmarks)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import UserError
from .decode import Decoder, decode_pixels
from .guidance import Guidance, GuidedDenoiser, unwrap_model
from .labels import check_classes
from .noise import SampleNoise
from .samplers import run_sampler


def sample_latents(model: torch.nn.Module, diffusion_spec: dict[str, Any], labels: Sequence[int] | np.ndarray | torch.Tensor,
                   *, indices: Sequence[int] | np.ndarray | None = None, seed: int = 0, sampler: str = "ddpm",
                   steps: int = 250, cfg_scale: float = 1.0, cfg_channels: int | None = None,
                   guidance_interval: tuple[float, float] | None = None, precision: str = "fp32",
                   guidance: Guidance | None = None) -> torch.Tensor:
    """x_0 (N, C, H, W) float32 for the given labels; sample j uses the random streams of
    (seed, indices[j]) (indices default to 0..N-1), so it does not depend on the batch it is in.

    diffusion_spec: {"num_timesteps", "beta_start", "beta_end", "learn_sigma"} (a checkpoint's spec["diffusion"]).
    """
    net = unwrap_model(model)
    device = next(net.parameters()).device
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 1 or len(labels) == 0:
        raise UserError("labels must be a non-empty 1-D list of class ids")
    check_classes(labels.unique().tolist(), int(net.num_classes))
    indices = np.arange(len(labels)) if indices is None else np.asarray(indices)
    if len(indices) != len(labels):
        raise ValueError(f"{len(indices)} indices for {len(labels)} labels")
    if guidance is None:
        guidance = Guidance(float(cfg_scale), cfg_channels, guidance_interval)
    denoiser = GuidedDenoiser(net, guidance, precision)
    noise = SampleNoise(seed, indices, (net.in_channels, net.input_size, net.input_size), device)
    was_training = net.training
    net.eval()  # no label dropout while sampling
    try:
        return run_sampler(denoiser, labels.to(device), noise, sampler=sampler, steps=steps,
                           diffusion_spec=diffusion_spec)
    finally:
        net.train(was_training)


def sample_images(model: torch.nn.Module, diffusion_spec: dict[str, Any], labels: Sequence[int] | np.ndarray | torch.Tensor,
                  *, decoder: Decoder | None = None, **kwargs: Any) -> np.ndarray:
    """uint8 (N, H, W, C) images (C = 1 for grayscale pixel models, 3 after a VAE); keyword
    arguments as for `sample_latents`. `decoder` defaults to the pixel-space rescale; latent models
    pass `build_decoder(...)`."""
    return (decoder or decode_pixels)(sample_latents(model, diffusion_spec, labels, **kwargs))
