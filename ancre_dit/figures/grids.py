"""Sample grids: a batch of images as one PNG (torchvision's make_grid and save_image, as DiT does)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torchvision.utils import make_grid, save_image


def save_image_grid(images, path: str | Path, nrow: int = 8, scale: int | None = None) -> Path:
    """A grid PNG of uint8 NHWC or float NCHW images in [-1, 1], upscaled `scale` times (nearest; by default
    to at least 64 pixels a side)."""
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images.detach().cpu()
    if x.ndim != 4:
        raise ValueError(f"images must be a 4-D batch (NHWC uint8 or NCHW float), got shape {tuple(x.shape)}")
    x = x.permute(0, 3, 1, 2).float() / 255.0 if x.dtype == torch.uint8 else ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    if scale is None:
        scale = max(1, -(-64 // min(x.shape[-2:])))
    if scale > 1:
        x = torch.nn.functional.interpolate(x, scale_factor=scale, mode="nearest")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(x, nrow=nrow, padding=max(1, scale), pad_value=0.5), path)
    return path
