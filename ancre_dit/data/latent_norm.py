"""How stored latents are normalised for training (`data.latent_norm`), and the per-channel statistics
extraction records for it.

- `scale`: the latents as stored, (z - shift) * scaling_factor (the VAE config's factors; SD-VAE's 0.18215).
- `channel`: additionally (x - channel_mean) / channel_std per channel (LightningDiT's convention for VAEs
  whose channels differ in scale); decoding inverts it first, so samples come out in the VAE's own space.

The statistics are the training distribution's, the posterior sample x = mean + std * eps over every image
and its flip: per channel E[x] = E[mean] and Var[x] = Var[mean] + E[std^2], exactly from sums (no draws).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UserError

LATENT_NORMS = ("scale", "channel")
# Real latent channels have std of order 0.1-10; a std this small is a constant or edited channel.
MIN_CHANNEL_STD = 1e-4


def moment_sums(mean: np.ndarray, std: np.ndarray) -> dict[str, Any]:
    """Per-channel sums of one shard's stored moments, (n, 2, C, h, w) each, in float64."""
    m, s = mean.astype(np.float64), std.astype(np.float64)
    axes = (0, 1, 3, 4)
    return {"n": int(m.size // m.shape[2]) if m.size else 0, "sum": m.sum(axis=axes).tolist(),
            "sumsq": (m * m).sum(axis=axes).tolist(), "var_sum": (s * s).sum(axis=axes).tolist()}


def channel_statistics(parts: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(channel_mean, channel_std) of the posterior samples from the shards' `moment_sums`."""
    n = sum(p["n"] for p in parts)
    if not n:
        return [], []
    total = {k: np.sum([np.asarray(p[k]) for p in parts if p["n"]], axis=0) for k in ("sum", "sumsq", "var_sum")}
    mu = total["sum"] / n
    var = np.maximum(total["sumsq"] / n - mu * mu, 0.0) + total["var_sum"] / n
    return mu.tolist(), np.sqrt(var).tolist()


class ChannelNorm:
    """(x - mean) / std per channel of (N, C, h, w) latents, and its inverse."""

    def __init__(self, mean: list[float], std: list[float], where: str = "the latents"):
        self.mean = torch.tensor(mean, dtype=torch.float64).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
        if not bool(self.mean.isfinite().all() and self.std.isfinite().all()):
            raise UserError(f"{where}: channel_mean / channel_std hold a non-finite value; the statistics are damaged, "
                            "extract the latents again or use data.latent_norm=scale")
        if not bool((self.std > MIN_CHANNEL_STD).all()):
            raise UserError(f"{where}: channel_std has an entry of {float(self.std.min()):g}, at or below "
                            f"{MIN_CHANNEL_STD:g}: dividing by it would blow the channel up; a constant or damaged "
                            "channel cannot be normalised (use data.latent_norm=scale)")
        self.mean, self.std = self.mean.float(), self.std.float()
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"{x.device}/{x.dtype}"  # cached per device: no host copy per training step
        if key not in self._on:
            self._on[key] = (self.mean.to(x.device, x.dtype), self.std.to(x.device, x.dtype))
        return self._on[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(x)
        return (x - mean) / std

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(x)
        return x * std + mean

    def spec(self) -> dict[str, Any]:
        """The checkpoint spec's record, so sampling needs no data folder."""
        return {"latent_norm": "channel", "channel_mean": self.mean.flatten().tolist(),
                "channel_std": self.std.flatten().tolist()}


def latent_norm_from_manifest(mode: str, manifest: dict[str, Any], where: str) -> ChannelNorm | None:
    """None for `scale`; the manifest's statistics for `channel` (refused when it has none)."""
    if mode not in LATENT_NORMS:
        raise UserError(f"data.latent_norm must be one of {', '.join(LATENT_NORMS)}, got {mode}")
    if mode == "scale":
        return None
    mean, std = manifest.get("channel_mean"), manifest.get("channel_std")
    channels = int(manifest["latent_shape"][0])
    if not mean or not std or len(mean) != channels or len(std) != channels:
        raise UserError(f"data.latent_norm=channel needs the per-channel statistics of the latents, but {where} "
                        "has none (extracted by an older version); rerun extract_latents.py into a new folder, "
                        "or set data.latent_norm=scale")
    return ChannelNorm(mean, std, where)


def latent_norm_from_spec(data_spec: dict[str, Any]) -> ChannelNorm | None:
    """The normalisation a checkpoint was trained with (None: `scale`, also for older checkpoints)."""
    if data_spec.get("latent_norm", "scale") != "channel":
        return None
    return ChannelNorm(data_spec["channel_mean"], data_spec["channel_std"], "the checkpoint's data spec")
