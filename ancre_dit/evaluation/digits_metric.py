"""The digits metric for the 8x8 digits default. It is NOT FID-50K and not comparable with any paper.

Inception does not fit 8x8 grayscale images, so generated digits are scored by:
- accuracy (`digits_acc`): how often an independent classifier, an RBF SVC (C=10, gamma=0.001) fitted
  on the "train" split of scikit-learn's digits (the split the DiT trains on), assigns a generated image
  its conditioning label. Chance is 0.10; real held-out digits score `real_heldout_acc` (0.99);
- pixel Fréchet distance (`digits_fd`): against the real "train" digits in raw 64-d pixel space
  (sklearn's 0..16 scale); the real held-out digits give `real_heldout_fd`, the floor a perfect model
  reaches with that many images (the distance grows with fewer).
The SVC fits deterministically in a fraction of a second (every process gets the same one, with no
weights to cache), and depends on no learned features. Generated uint8 u in 0..255 maps to u * 16 / 255.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .metrics import feature_statistics, frechet_distance


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
def _reference() -> dict[str, object]:
    """Pixel statistics of the real training digits and what the real held-out digits score."""
    train_pixels, _ = _real_digits()["train"]
    pixels, labels = _real_digits()["heldout"]
    mu, sigma = feature_statistics(train_pixels)
    return {"mu": mu, "sigma": sigma, "count": len(labels),
            "real_heldout_acc": float((_classifier().predict(pixels) == labels).mean()),
            "real_heldout_fd": frechet_distance(*feature_statistics(pixels), mu, sigma, method="eigh")}


def classify(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (N, 8, 8[, 1|3]) images (equal channels averaged) -> (pixels float64 (N, 64) on 0..16,
    predicted class (N,)): what `digits_metric` needs, computed part by part."""
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise ValueError(f"the digits metric expects uint8 images in 0..255 (as sampling writes them), got {x.dtype}")
    if x.ndim == 4:
        x = x.astype(np.float64).mean(axis=-1)
    if x.ndim != 3 or x.shape[1:] != (8, 8):
        raise ValueError(f"the digits metric expects (N, 8, 8[, 1|3]) images, got shape {np.asarray(images).shape}")
    pixels = x.reshape(len(x), 64).astype(np.float64) * (16.0 / 255.0)
    return pixels, _classifier().predict(pixels).astype(np.int64)


def digits_metric(pixels: np.ndarray, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """{digits_acc, digits_fd} of generated digits from their `classify` outputs and conditioning labels."""
    ref = _reference()
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    if len(labels) != len(pixels):
        raise ValueError(f"{len(labels)} labels for {len(pixels)} images")
    out = {"digits_acc": float((np.asarray(predictions) == labels).mean()), "digits_fd": float("nan")}
    if len(pixels) >= 2:  # a covariance needs two images
        out["digits_fd"] = frechet_distance(*feature_statistics(pixels), ref["mu"], ref["sigma"], method="eigh")
    return out


def digits_reference_scores() -> dict[str, float]:
    """What real held-out digits score: {real_heldout_acc, real_heldout_fd} (the metric's ceiling / floor)."""
    ref = _reference()
    return {"real_heldout_acc": ref["real_heldout_acc"], "real_heldout_fd": ref["real_heldout_fd"]}


def digits_report(images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The digits metric of a batch of samples with its reference (NOT FID-50K; see the module docstring)."""
    pixels, predictions = classify(images)
    scores, ref = digits_metric(pixels, predictions, labels), _reference()
    return {"accuracy": scores["digits_acc"], "pixel_fd": scores["digits_fd"], "num_samples": float(len(pixels)),
            "chance_accuracy": 0.1, "real_heldout_accuracy": ref["real_heldout_acc"],
            "real_heldout_pixel_fd": ref["real_heldout_fd"], "real_heldout_count": float(ref["count"])}


def format_digits_report(report: dict[str, float]) -> str:
    """A short human-readable summary that says what the numbers are (and are not)."""
    n = int(report["num_samples"])
    return (f"digits offline check on {n} samples (NOT FID-50K; not comparable with papers):\n"
            f"  class accuracy   {report['accuracy']:.3f}  (independent SVC on real digits; chance "
            f"{report['chance_accuracy']:.2f}, real held-out {report['real_heldout_accuracy']:.3f})\n"
            f"  pixel Fréchet    {report['pixel_fd']:.3f}  (64-d pixels vs real train digits; real held-out "
            f"{int(report['real_heldout_count'])} images: {report['real_heldout_pixel_fd']:.3f}; lower is better, "
            f"and it grows when there are few samples)")
