"""The VAE of latent models: loading a diffusers autoencoder (a local folder; a hub id only when the user
passes one), encoding images to scaled moments (latent extraction) and decoding latents to uint8 images in
chunks (sampling, the trainer's grids). The class is the folder config's `_class_name` (`VAE_CLASSES`):
AutoencoderKL of any latent channel count, or AutoencoderDC (DC-AE, deterministic: its posterior std is 0).
With `data.latent_norm: channel`, `LoadedVAE.latent_norm` undoes the per-channel normalisation first."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data.adm_npz import to_uint8
from .data.latent_norm import ChannelNorm, latent_norm_from_spec
from .errors import UserError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedVAE:
    vae: torch.nn.Module
    name: str  # what the user passed: a folder or a hub id
    scaling_factor: float
    shift_factor: float | None
    downsample: int
    latent_channels: int
    kind: str = "AutoencoderKL"
    latent_norm: ChannelNorm | None = None  # set: latents are (z - mean) / std per channel (latent_norm channel)


# config `_class_name` -> the config entry whose length n gives the downsampling factor, 2 ** (n - 1).
VAE_CLASSES = {"AutoencoderKL": "block_out_channels", "AutoencoderDC": "encoder_block_out_channels"}


def locate_vae(name: str) -> tuple[str, str | None, str, dict | None]:
    """(what to give from_pretrained, subfolder, autoencoder class, its config.json; None for a hub id) of a
    VAE folder, a whole Stable Diffusion pipeline folder (its vae/ subfolder) or, with network, a hub id."""
    path = Path(name).expanduser()
    if not path.is_dir():
        if path.exists() or not _HUB_ID.match(name):
            raise UserError(f"--vae {name} is not a folder; pass a local diffusers AutoencoderKL folder "
                            "(config.json + weights), or a hub id such as stabilityai/sd-vae-ft-ema if you have "
                            "network")
        return name, None, "AutoencoderKL", None  # hub ids: as before
    subfolder = next((sub for sub in ("", "vae") if (path / sub / "config.json").is_file()), None)
    if subfolder is None:
        raise UserError(f"--vae {name} holds no config.json (nor vae/config.json); pass the folder of a "
                        "diffusers AutoencoderKL (e.g. a local copy of stabilityai/sd-vae-ft-ema)")
    config_path = path / subfolder / "config.json"
    try:
        config = json.loads(config_path.read_text())
        kind = config.get("_class_name", "AutoencoderKL")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{config_path} is not a readable JSON config; pass a diffusers VAE folder") from None
    if kind not in VAE_CLASSES:
        raise UserError(f"{config_path} names the class {kind}, which is not a VAE this package loads; pass a "
                        f"folder of one of {', '.join(VAE_CLASSES)}")
    return str(path), subfolder or None, kind, config


def load_vae(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
             scaling_factor: float | None = None) -> LoadedVAE:
    """The VAE in eval mode on `device` in `dtype` (any failure is one UserError), its factors from its config."""
    import diffusers  # heavy import, only when a VAE is really needed

    source, subfolder, kind, folder_config = locate_vae(name)
    is_local = folder_config is not None
    try:
        vae = getattr(diffusers, kind).from_pretrained(source, subfolder=subfolder, local_files_only=is_local,
                                                       torch_dtype=dtype)
    except Exception as err:  # noqa: BLE001 - diffusers raises many kinds; all mean "cannot load"
        where = "the folder" if is_local else "the hub (needs network; or download it and pass the folder)"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"could not load {kind} from {where} {name}: {first}") from None
    config = vae.config
    shift = getattr(config, "shift_factor", None)
    return LoadedVAE(vae=vae.to(device=device).eval().requires_grad_(False), name=name,
                     scaling_factor=_scaling_factor(name, config) if scaling_factor is None else scaling_factor,
                     shift_factor=None if shift is None else float(shift),
                     downsample=2 ** (len(getattr(config, VAE_CLASSES[kind])) - 1),
                     latent_channels=int(config.latent_channels), kind=kind)


def _scaling_factor(name: str, config) -> float:
    """The VAE config's scaling_factor; refused when its config.json gives none (diffusers would silently take
    SD's 0.18215) or no positive number."""
    if "scaling_factor" in getattr(config, "_use_default_values", ()):
        raise UserError(f"the VAE config of {name} sets no scaling_factor (diffusers would take SD's 0.18215, wrong "
                        "for most other VAEs); add it to its config.json or pass --scaling-factor")
    value = config.scaling_factor
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = float("nan")
    if isinstance(value, bool) or not (math.isfinite(factor) and factor > 0):
        raise UserError(f"the VAE config of {name} has scaling_factor {value!r}, not a positive number; fix its "
                        "config.json or pass --scaling-factor")
    return factor


def check_vae_fits(name: str, latent_shape: tuple[int, int, int], image_size: int) -> None:
    """Refuses a local VAE folder whose latents are not the data's, from its config alone: at start, not at
    the first grid."""
    _, _, kind, config = locate_vae(name)
    if config is None:
        return  # a hub id: checked when it is loaded
    try:
        channels, down = int(config["latent_channels"]), 2 ** (len(config[VAE_CLASSES[kind]]) - 1)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"data.vae {name}: its config.json lacks latent_channels or its block channels") from None
    c, h, _ = latent_shape
    if channels != c or image_size // down != h:
        raise UserError(f"data.vae {name} makes {channels}x{image_size // down}x{image_size // down} latents of "
                        f"{image_size} px images but the data holds {c}x{h}x{h}; name the VAE the latents were "
                        "extracted with")


def to_vae_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float32 (N, 3, H, W) in [-1, 1], computed as ToTensor + Normalize(0.5, 0.5)
    (what DiT's data pipeline does) so the pixels the VAE sees match DiT's bit for bit."""
    x = images.permute(0, 3, 1, 2).float().div(255)
    return (x - 0.5) / 0.5


@torch.inference_mode()
def encode_moments(loaded: LoadedVAE, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (N, H, W, 3) -> float32 (mean, std), each (N, C, h, w), already shifted and scaled
    ((z - shift) * scale, so a sample is mean + std * eps in the space the DiT is trained on)."""
    param = next(loaded.vae.parameters())
    x = to_vae_input(images).to(device=param.device, dtype=param.dtype)
    if loaded.kind == "AutoencoderDC":  # deterministic
        mean = loaded.vae.encode(x).latent.float()
        std = torch.zeros_like(mean)
    else:
        posterior = loaded.vae.encode(x).latent_dist
        mean, std = posterior.mean.float(), posterior.std.float()
    if loaded.shift_factor is not None:
        mean = mean - loaded.shift_factor
    return mean * loaded.scaling_factor, std * loaded.scaling_factor


def load_run_vae(data_spec: dict[str, Any], latent_channels: int, vae: str | None = None,
                 device: torch.device | str = "cpu") -> LoadedVAE:
    """The VAE a trained latent model decodes with (`vae`, else its run's), with the run's scaling factor."""
    named = vae or data_spec.get("vae")
    if not named:
        raise UserError("this checkpoint samples VAE latents but its run names no VAE; pass --vae DIR "
                        "(the local diffusers AutoencoderKL folder the latents were extracted with)")
    if not vae and not Path(str(named)).expanduser().exists() and not _HUB_ID.match(str(named)):
        raise UserError(f"the VAE this run was trained with, {named}, is not there any more (moved or deleted); "
                        "pass --vae DIR, the diffusers AutoencoderKL folder its latents were extracted with")
    loaded = load_vae(str(named), device, scaling_factor=data_spec.get("scaling_factor"))
    loaded.latent_norm = latent_norm_from_spec(data_spec)  # trained on (x - mean) / std: decoding undoes it first
    if loaded.latent_channels != latent_channels:
        raise UserError(f"VAE {named} has {loaded.latent_channels} latent channels but the model samples "
                        f"{latent_channels}; pass the VAE the latents were extracted with (--vae DIR)")
    return loaded


@torch.no_grad()
def decode_to_uint8(loaded: LoadedVAE, z: torch.Tensor, chunk: int = 32) -> np.ndarray:
    """Latents (N, C, h, w), scaled as trained -> uint8 RGB (N, H, W, 3), decoded `chunk` at a time."""
    param = next(loaded.vae.parameters())
    out = []
    for part in z.split(chunk):
        if loaded.latent_norm is not None:
            part = loaded.latent_norm.invert(part.float())
        latents = part.to(param.device, param.dtype) / loaded.scaling_factor
        if loaded.shift_factor is not None:
            latents = latents + loaded.shift_factor
        out.append(to_uint8(loaded.vae.decode(latents).sample).transpose(0, 2, 3, 1))
    return np.concatenate(out)
