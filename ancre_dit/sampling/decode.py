"""From the sampler's output to uint8 images: VAE decoding for latent models, a plain rescale for
pixel-space models (digits)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..data.adm_npz import to_uint8

Decoder = Callable[[torch.Tensor], np.ndarray]


def to_uint8_nhwc(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> uint8 (N, H, W, C), clipped and rounded to nearest."""
    return to_uint8(x).transpose(0, 2, 3, 1)


def decode_pixels(x: torch.Tensor) -> np.ndarray:
    """Pixel-space models sample images directly."""
    return to_uint8_nhwc(x)


class VAEDecoder:
    """Latents (scaled by the VAE's scaling factor, as trained) -> uint8 RGB via AutoencoderKL."""

    def __init__(self, loaded, chunk: int = 32):
        self.loaded = loaded  # ancre_dit.latents.vae.LoadedVAE
        self.chunk = chunk

    @torch.no_grad()
    def __call__(self, z: torch.Tensor) -> np.ndarray:
        vae = self.loaded.vae
        param = next(vae.parameters())
        out = []
        for part in z.split(self.chunk):
            latents = part.to(param.device, param.dtype) / self.loaded.scaling_factor
            if self.loaded.shift_factor is not None:
                latents = latents + self.loaded.shift_factor
            out.append(to_uint8_nhwc(vae.decode(latents).sample))
        return np.concatenate(out)


def build_decoder(data_spec: dict[str, Any], model_channels: int, vae: str | None = None,
                  device: torch.device | str = "cpu") -> Decoder:
    """The decoder a checkpoint needs: its run's VAE (or `vae`, a local folder that overrides it) for
    latent models; none for pixel-space models."""
    kind = data_spec.get("kind")
    named = vae or data_spec.get("vae")
    if kind != "latents":
        if vae:
            raise UserError(f"--vae given, but this checkpoint is a pixel-space ({kind}) model that needs no VAE; drop --vae")
        return decode_pixels
    if not named:
        raise UserError("this checkpoint samples VAE latents but its run names no VAE; pass --vae DIR "
                        "(the local diffusers AutoencoderKL folder the latents were extracted with)")
    from ..latents.vae import load_vae  # diffusers import only when a VAE is needed

    loaded = load_vae(str(named), device, scaling_factor=data_spec.get("scaling_factor"))
    if loaded.latent_channels != model_channels:
        raise UserError(f"VAE {named} has {loaded.latent_channels} latent channels but the model samples "
                        f"{model_channels}; pass the VAE the latents were extracted with (--vae DIR)")
    return VAEDecoder(loaded)
