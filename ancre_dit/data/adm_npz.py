"""The ADM sample / reference-batch .npz layout, read and written by sampling and evaluation.

`arr_0`: uint8 images (N, H, W, 3); `arr_1`: int64 labels (N,) when known. ADM reference batches may also
hold Inception statistics: `mu`, `sigma` (pool features) and `mu_s`, `sigma_s` (spatial features).
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ..errors import MissingFileError, UserError

STAT_KEYS = ("mu", "sigma", "mu_s", "sigma_s", "mu_dinov2", "sigma_dinov2")  # the last two: FD-DINOv2
STAT_PAIRS = tuple(zip(STAT_KEYS[::2], STAT_KEYS[1::2]))  # (mean, covariance)


@dataclass
class ADMBatch:
    images: np.ndarray | None  # uint8 (N, H, W, 3), None for a statistics-only reference
    labels: np.ndarray | None  # int64 (N,)
    stats: dict[str, np.ndarray] = field(default_factory=dict)


def to_uint8(images) -> np.ndarray:
    """Images in [-1, 1] (tensor or array, any shape) -> uint8 0..255, clipped, rounded to nearest: the one
    place that fixes how model outputs become pixels (samples, grids, digits checks)."""
    if hasattr(images, "detach"):
        images = images.detach().float().cpu().numpy()
    x = np.asarray(images, dtype=np.float32)
    return np.clip(np.rint((x + 1.0) * 127.5), 0, 255).astype(np.uint8)


def to_rgb_uint8(images: np.ndarray) -> np.ndarray:
    """(N, H, W), (N, H, W, 1) or (N, H, W, 3) uint8 -> (N, H, W, 3); grayscale gets 3 equal channels."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"ADM images must be uint8, got {images.dtype}; convert with to_uint8 first")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"ADM images must be (N, H, W[, 1|3]), got shape {images.shape}"
                         + ("; drop the alpha channel (images[..., :3])" if images.shape[-1] == 4 else ""))
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images


def save_adm_npz(path: str | os.PathLike, images: np.ndarray | None, labels: np.ndarray | None = None,
                 **stats: np.ndarray) -> Path:
    """Writes an ADM npz atomically (temporary file, then rename): a crash never leaves half a file."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    if images is not None:
        arrays["arr_0"] = to_rgb_uint8(images)
    if labels is not None:
        labels = np.asarray(labels, dtype=np.int64)
        if images is not None and len(labels) != len(arrays["arr_0"]):
            raise ValueError(f"{len(labels)} labels for {len(arrays['arr_0'])} images")
        arrays["arr_1"] = labels
    if unknown := [key for key in stats if key not in STAT_KEYS]:
        raise ValueError(f"unknown statistic {unknown[0]!r}; ADM references hold {', '.join(STAT_KEYS)}")
    arrays.update((key, np.asarray(value)) for key, value in stats.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return path


def load_adm_npz(path: str | os.PathLike) -> ADMBatch:
    """Reads a sample file or an ADM reference batch; a missing or corrupt file is one clear error."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; pass an .npz written by sample.py or an ADM reference batch")
    try:
        with np.load(path) as data:
            keys = set(data.files)
            images = to_rgb_uint8(data["arr_0"]) if "arr_0" in keys else None
            labels = data["arr_1"] if "arr_1" in keys else None
            stats = {k: data[k] for k in STAT_KEYS if k in keys}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise UserError(f"{path} is not a readable ADM .npz ({err}); regenerate it") from None
    if images is None and not stats:
        raise UserError(f"{path} holds neither images (arr_0) nor statistics (mu, sigma)")
    if labels is not None:
        labels = check_labels(labels, None if images is None else len(images), path)
    check_stats(stats, path)
    return ADMBatch(images, labels, stats)


def check_labels(labels: np.ndarray, num_images: int | None, path: Path) -> np.ndarray:
    """arr_1 as int64 class indices, one per image; floats or a count that disagrees are refused
    (a cast would turn 1.7 into class 1, a short list would pair images with other labels)."""
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"{path}: arr_1 holds {labels.dtype} {tuple(labels.shape)}, not one integer class label per "
                        "image; regenerate the file with sample.py")
    if num_images is not None and len(labels) != num_images:
        raise UserError(f"{path} holds {num_images} images (arr_0) but {len(labels)} labels (arr_1); "
                        "regenerate the file with sample.py")
    return labels.astype(np.int64)


def check_stats(stats: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Each mean comes with its covariance, shaped (D,) and (D, D), every value finite: a statistic
    that cannot be right is refused here rather than scored into a NaN."""
    for mu_key, sigma_key in STAT_PAIRS:
        if (mu_key in stats) != (sigma_key in stats):
            have, lack = (mu_key, sigma_key) if mu_key in stats else (sigma_key, mu_key)
            raise UserError(f"{path} holds {have} but no {lack}; recompute the reference statistics "
                            "(evaluate.py --save-ref-stats)")
        if mu_key not in stats:
            continue
        mu, sigma = np.asarray(stats[mu_key]), np.asarray(stats[sigma_key])
        if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
            raise UserError(f"{path}: {mu_key} {tuple(mu.shape)} and {sigma_key} {tuple(sigma.shape)} are not a mean "
                            "(D,) and its covariance (D, D); recompute the reference statistics")
        for key, value in ((mu_key, mu), (sigma_key, sigma)):
            if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
                raise UserError(f"{path}: {key} holds non-finite values (NaN or infinity); recompute the reference "
                                "statistics (evaluate.py --save-ref-stats)")
