"""An offline check for the 8x8 digits default. It is NOT FID-50K and not comparable with any paper.

Inception metrics need a 91 MB weights file and 299x299 inputs; the quickstart instead reports:
- `accuracy`: how often an independent classifier (an RBF SVC, C=10, gamma=0.001, trained
  deterministically on the "train" split of scikit-learn's digits, the split the DiT trains on)
  assigns a generated image its conditioning label. Chance is 0.10; held-out real digits score
  `real_heldout_accuracy` (~0.99);
- `pixel_fd`: the Fréchet distance between generated images and the real "train" digits in raw
  64-d pixel space (sklearn's 0..16 scale), Inception-free; `real_heldout_pixel_fd` is the same
  distance for the real held-out digits, the floor a perfect model would reach with that many images.
Pixel mapping: generated uint8 u in 0..255 -> u * 16 / 255 (sklearn's digits are 0..16 floats, the
training data maps them linearly to [-1, 1] and sampling maps [-1, 1] linearly to 0..255).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .metrics import feature_statistics, frechet_distance

_SCALE = 16.0 / 255.0


def _pixels(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 8, 8), (N, 8, 8, 1) or (N, 8, 8, 3) (equal channels averaged) -> (N, 64) on 0..16."""
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise ValueError(f"digits_report expects uint8 images in 0..255 (as sample.py writes), got {x.dtype}")
    if x.ndim == 4:
        x = x.astype(np.float64).mean(axis=-1)
    if x.ndim != 3 or x.shape[1:] != (8, 8):
        raise ValueError(f"digits_report expects (N, 8, 8[, 1|3]) images, got shape {np.asarray(images).shape}")
    return x.reshape(len(x), 64).astype(np.float64) * _SCALE


@lru_cache(maxsize=1)
def _real_digits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(pixels 0..16 (N, 64), labels) of the train and heldout splits the training code uses."""
    from ..data.digits import DigitsDataset

    out = {}
    for split in ("train", "heldout"):
        ds = DigitsDataset(split)
        pixels = (ds.images.numpy().reshape(len(ds), 64).astype(np.float64) + 1.0) * 8.0  # [-1, 1] -> 0..16
        out[split] = (pixels, ds.labels.numpy().astype(np.int64))
    return out


@lru_cache(maxsize=1)
def _classifier():
    from sklearn.svm import SVC

    pixels, labels = _real_digits()["train"]
    return SVC(C=10.0, gamma=0.001).fit(pixels, labels)  # deterministic: no randomness in SVC.fit


@lru_cache(maxsize=1)
def _baseline() -> tuple[float, float, int]:
    train_pixels, _ = _real_digits()["train"]
    pixels, labels = _real_digits()["heldout"]
    accuracy = float((_classifier().predict(pixels) == labels).mean())
    fd = frechet_distance(*feature_statistics(pixels), *feature_statistics(train_pixels), method="eigh")
    return accuracy, fd, len(labels)


def digits_report(images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Offline quality report for generated 8x8 digits (NOT FID-50K; see the module docstring).

    Keys: accuracy, pixel_fd, num_samples, chance_accuracy, real_heldout_accuracy,
    real_heldout_pixel_fd, real_heldout_count."""
    pixels = _pixels(images)
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    if len(labels) != len(pixels):
        raise ValueError(f"{len(labels)} labels for {len(pixels)} images")
    train_pixels, _ = _real_digits()["train"]
    real_acc, real_fd, real_count = _baseline()
    report = {
        "accuracy": float((_classifier().predict(pixels) == labels).mean()),
        "pixel_fd": float("nan"),
        "num_samples": float(len(pixels)),
        "chance_accuracy": 0.1,
        "real_heldout_accuracy": real_acc,
        "real_heldout_pixel_fd": real_fd,
        "real_heldout_count": float(real_count),
    }
    if len(pixels) >= 2:  # a covariance needs two images
        report["pixel_fd"] = frechet_distance(*feature_statistics(pixels), *feature_statistics(train_pixels),
                                              method="eigh")
    return report


def format_digits_report(report: dict[str, float]) -> str:
    """A short human-readable summary that says what the numbers are (and are not)."""
    n = int(report["num_samples"])
    return (f"digits offline check on {n} samples (NOT FID-50K; not comparable with papers):\n"
            f"  class accuracy   {report['accuracy']:.3f}  (independent SVC on real digits; chance "
            f"{report['chance_accuracy']:.2f}, real held-out {report['real_heldout_accuracy']:.3f})\n"
            f"  pixel Fréchet    {report['pixel_fd']:.3f}  (64-d pixels vs real train digits; real held-out "
            f"{int(report['real_heldout_count'])} images: {report['real_heldout_pixel_fd']:.3f}; lower is better, "
            f"and it grows when there are few samples)")
