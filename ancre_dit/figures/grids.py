"""Sample grids: a batch of images as one PNG, small images enlarged so the grid is readable.

The tiling is torchvision's make_grid and save_image, written with einops (tests/test_digits.py
holds the PNG to torchvision's): importing torchvision imports torch's compiler, seconds in every
sample.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from einops import rearrange
from PIL import Image


def save_image_grid(images, path: str | Path, nrow: int = 8, scale: int | None = None) -> Path:
    """Saves a grid PNG of uint8 NHWC images (ADM sample layout) or float NCHW images in [-1, 1].

    `scale` is an integer nearest-neighbour upscale; by default small images (e.g. 8x8 digits)
    are enlarged to at least 64 pixels a side so the grid is readable.
    """
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images.detach().cpu()
    if x.ndim != 4:
        raise ValueError(f"images must be a 4-D batch (NHWC uint8 or NCHW float), got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.permute(0, 3, 1, 2).float() / 255.0
    else:
        x = ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    if scale is None:
        scale = max(1, -(-64 // min(x.shape[-2:])))
    if scale > 1:
        x = torch.nn.functional.interpolate(x, scale_factor=scale, mode="nearest")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_tile(x, nrow, padding=max(1, scale), fill=0.5)).save(path)
    return path


def _tile(x: torch.Tensor, nrow: int, padding: int, fill: float) -> np.ndarray:
    """(N, C, H, W) in [0, 1] -> (rows (H + p) + p, cols (W + p) + p, 3) uint8: `nrow` images a row,
    `padding` pixels of `fill` around each, grey images as RGB, an unfilled last row left as fill."""
    cols = min(nrow, len(x))
    rows = -(-len(x) // cols)
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    x = torch.cat([x, x.new_full((rows * cols - len(x), *x.shape[1:]), fill)])
    cells = torch.nn.functional.pad(x, (0, padding, 0, padding), value=fill)
    grid = torch.nn.functional.pad(rearrange(cells, "(r c) ch h w -> ch (r h) (c w)", r=rows), (padding, 0, padding, 0),
                                   value=fill)
    return grid.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to(torch.uint8).numpy()
