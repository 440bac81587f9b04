"""FD-DINOv2: the Fréchet distance between DINOv2 ViT-L/14 CLS features (Stein et al.'s dgm-eval,
EDM2's second metric), from a local timm weights file.

EDM2's / dgm-eval's protocol: uint8 images -> [0, 1], resized to 224 x 224 (bicubic, antialiased),
normalised with ImageNet's mean and std; the feature is the CLS token after the final norm; the
statistics and the distance are FID's (a reference npz stores them as `mu_dinov2` / `sigma_dinov2`).
Values agree closely with EDM2's and dgm-eval's, not to the digit: their torch.hub model interpolates
its position embedding at every forward, timm once at load; torch-fidelity's `fd-dinov2` resizes
bilinear without antialiasing. Compare FD-DINOv2 values only between runs of one implementation.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data.adm_npz import to_rgb_uint8
from ..errors import MissingFileError, UserError
from ..hardware import full_fp32
from ..models.timm_weights import load_timm_weights, weights_hint

DINOV2_MODEL = "vit_large_patch14_dinov2"
RESOLUTION = 224
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DinoV2Extractor:
    """A timm DINOv2 ViT built for 224 px, weights from `weights` (nothing is downloaded)."""

    def __init__(self, weights: str | os.PathLike, model: str = DINOV2_MODEL, device: str | torch.device = "cpu"):
        import timm

        if not weights or not Path(weights).is_file():
            raise MissingFileError(f"--dinov2-weights {weights} does not exist; "
                                   f"{weights_hint(model, '--dinov2-weights PATH')}")
        try:
            net = timm.create_model(model, pretrained=False, num_classes=0, img_size=RESOLUTION)
        except (RuntimeError, TypeError, ValueError) as err:
            raise UserError(f"--dinov2-model {model} is not a timm ViT ({' '.join(str(err).split())})") from None
        load_timm_weights(net, weights, model, flag="--dinov2-weights", name_flag="--dinov2-model")
        self.net = net.eval().requires_grad_(False).to(device)
        self.weights, self.model, self.device = Path(weights), model, torch.device(device)

    @torch.no_grad()
    def batch(self, images: np.ndarray) -> torch.Tensor:
        """uint8 (N, H, W[, 1|3]) -> float32 CLS features (N, D) on the CPU, from EDM2's resize and normalisation."""
        x = torch.from_numpy(np.require(to_rgb_uint8(images), requirements="CW")).to(self.device)
        x = x.permute(0, 3, 1, 2).to(torch.float32) / 255.0
        x = F.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bicubic", align_corners=False, antialias=True)
        mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        x = (x - mean) / std
        with full_fp32():
            tokens = self.net.forward_features(x)
        return tokens[:, 0].float().cpu()

    def extract(self, batches: Iterable[np.ndarray], total: int | None = None, desc: str = "dinov2") -> np.ndarray:
        out = [self.batch(b).numpy() for b in tqdm(batches, total=None, desc=desc, unit="batch",
                                                   disable=total is not None and total < 1000)]
        return np.concatenate(out).astype(np.float64) if out else np.zeros((0, self.net.num_features))
