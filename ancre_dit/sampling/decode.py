"""From the sampler's output to uint8 images: VAE decoding for latent models (ancre_dit.vae), a
plain rescale for pixel-space models (digits)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..data.adm_npz import to_uint8
from ..vae import decode_to_uint8, load_run_vae

Decoder = Callable[[torch.Tensor], np.ndarray]


def decode_pixels(x: torch.Tensor) -> np.ndarray:
    """Pixel-space models sample images directly: (N, C, H, W) in [-1, 1] -> uint8 (N, H, W, C),
    clipped and rounded to nearest."""
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
