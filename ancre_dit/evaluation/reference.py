"""Builds an ADM-compatible reference batch from a folder of real images.

The output npz holds `mu`, `sigma` (pool_3) and `mu_s`, `sigma_s` (mixed_6/conv[..., :7]) like
ADM's VIRTUAL_*.npz, and, optionally, the center-cropped images as `arr_0` (+ `arr_1` labels
when the folder has one subfolder per class) so precision / recall can be computed against it.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..data.adm_npz import save_adm_npz
from ..data.image_folder import list_image_folder
from .inception import default_device
from .metrics import feature_statistics
from .pipeline import default_batch_size, get_extractor
from .sources import ImageFolderBatches
from ..errors import UserError


def check_replaceable(out: Path) -> None:
    """An existing `out` is replaced only when it is a statistics file (mu, sigma, no images): a
    sample file or an ADM reference batch holds images that a rerun here would destroy."""
    if not out.exists():
        return
    try:
        with zipfile.ZipFile(out) as npz:
            members = set(npz.namelist())
    except (zipfile.BadZipFile, OSError):
        raise UserError(f"{out} exists and is not an .npz of reference statistics; move it or pick another "
                        "--save-ref-stats name") from None
    if "arr_0.npy" in members or "mu.npy" not in members:
        raise UserError(f"{out} exists and holds {'images (arr_0)' if 'arr_0.npy' in members else 'no statistics'}: "
                        "a sample file or an ADM reference batch, which writing statistics there would destroy; "
                        "pick another --save-ref-stats name")


def save_reference_stats(images_dir: str | os.PathLike, out: str | os.PathLike, weights: str | os.PathLike,
                         image_size: int = 256, with_images: bool = False, max_images: int | None = None,
                         seed: int = 0, batch_size: int | None = None, device: str | torch.device | None = None,
                         workers: int = 0, dinov2_weights: str | os.PathLike | None = None,
                         dinov2_model: str | None = None) -> Path:
    """Writes the Inception statistics of `images_dir`'s images, center-cropped to `image_size` as in
    training (and, optionally, the crops; with `dinov2_weights`, FD-DINOv2's statistics) to `out`.
    `max_images` keeps a seeded random subset (a sorted prefix of ImageNet would be a few classes)."""
    check_replaceable(Path(out))
    device = torch.device(device) if device is not None else default_device()
    extractor = get_extractor(weights, device)  # fail on bad weights before reading any image
    dinov2 = None
    if dinov2_weights:
        from .dinov2 import DINOV2_MODEL, get_dinov2_extractor
        dinov2 = get_dinov2_extractor(dinov2_weights, dinov2_model or DINOV2_MODEL, device)
    listing = list_image_folder(images_dir)
    files, labels = listing.paths(), listing.labels
    if max_images is not None and max_images < len(files):
        keep = np.sort(np.random.default_rng(seed).choice(len(files), max_images, replace=False))
        files = [files[i] for i in keep]
        labels = None if labels is None else [labels[i] for i in keep]
    if len(files) < 2:
        raise UserError(f"{images_dir} has {len(files)} image(s); statistics need at least 2")
    batches = ImageFolderBatches(files, image_size, batch_size or default_batch_size(device), workers)
    kept: list[np.ndarray] = []
    dinov2_parts: list[np.ndarray] = []

    def keep_images():  # one pass over the files: the cropped images are kept as they stream by
        for batch in batches:
            if with_images:
                kept.append(batch)
            if dinov2 is not None:
                dinov2_parts.append(dinov2.batch(batch).numpy().astype(np.float64))
            yield batch

    features = extractor.extract(keep_images(), total=len(files), desc="inception: reference images")
    stats = {}
    stats["mu"], stats["sigma"] = feature_statistics(features.pool)
    stats["mu_s"], stats["sigma_s"] = feature_statistics(features.spatial)
    if dinov2 is not None:
        stats["mu_dinov2"], stats["sigma_dinov2"] = feature_statistics(np.concatenate(dinov2_parts))
    images = np.concatenate(kept) if with_images else None
    return save_adm_npz(out, images, labels if with_images else None, **stats)
