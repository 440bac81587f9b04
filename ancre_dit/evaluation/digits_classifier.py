"""The digits metric: a small classifier network trained on the real training digits, used to score
generated 8x8 digits during training. It is a DIGITS METRIC, not FID and not comparable with papers.

- `digits_acc`: how often the classifier assigns a generated image its conditioning label (chance
  0.10; the real held-out digits score `real_heldout_acc`);
- `digits_fd`: the Fréchet distance between the classifier's penultimate features (64-d) of the
  generated images and of the real training digits (the real held-out digits give `real_heldout_fd`,
  the floor for 180 images; the distance grows when there are few samples).

Why a hand-written network: Inception does not fit 8x8 grayscale images, and an MLP of three layers
trained full-batch needs no library beyond torch. Training is deterministic (seeded init, full-batch
Adam, one thread, fp32), so every process and every run gets the same network; it is also cached on
disk ($ANCRE_DIT_CACHE, default ~/.cache/ancre-dit) so it is trained once per machine.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..files import write_atomic
from .metrics import feature_statistics, frechet_distance

VERSION = 1  # bump when the network or its training changes: the cache key and reported numbers follow
FEATURE_DIM = 64
_TRAIN_ITERS, _LR, _WEIGHT_DECAY, _SEED = 200, 1e-2, 1e-4, 0


class DigitsClassifier(nn.Module):
    """64 pixels in [-1, 1] -> 128 -> 64 features -> 10 logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, FEATURE_DIM), nn.ReLU())
        self.head = nn.Linear(FEATURE_DIM, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x.reshape(len(x), 64))
        return features, self.head(features)


def _cache_file() -> Path:
    root = Path(os.environ.get("ANCRE_DIT_CACHE") or Path.home() / ".cache" / "ancre-dit")
    return root / f"digits-classifier-v{VERSION}.pt"


def _split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from ..data.digits import DigitsDataset

    ds = DigitsDataset(split)
    return ds.images.reshape(len(ds), 64).float(), ds.labels.long()


def _train() -> DigitsClassifier:
    """Full-batch Adam on the training split, seeded, on one thread (bitwise reproducible on a machine)."""
    x, y = _split("train")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # fork_rng: leave the caller's random streams untouched; enable_grad: callers may be in no_grad.
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(_SEED)
            net = DigitsClassifier()
            opt = torch.optim.Adam(net.parameters(), lr=_LR, weight_decay=_WEIGHT_DECAY)
            for _ in range(_TRAIN_ITERS):
                loss = nn.functional.cross_entropy(net(x)[1], y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return net.eval().requires_grad_(False)


@lru_cache(maxsize=1)
def digits_classifier() -> DigitsClassifier:
    """The cached network (trained on first use; the disk cache is best effort)."""
    path = _cache_file()
    if path.is_file():
        try:
            net = DigitsClassifier()
            net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return net.eval().requires_grad_(False)
        except Exception:  # a corrupt or foreign cache file: retrain and overwrite it
            pass
    net = _train()
    try:
        import io
        buffer = io.BytesIO()
        torch.save(net.state_dict(), buffer)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())
    except OSError:
        pass
    return net


@torch.no_grad()
def classify(images: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (N, 8, 8[, 1|3]) images (as sampling writes them), or float (N, 64|1x8x8) in [-1, 1]
    -> (features float64 (N, 64), predicted class (N,))."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if x.dtype == torch.uint8:
        x = x.float()
        if x.ndim == 4:  # equal channels (grayscale written as RGB): average them
            x = x.mean(dim=-1)
        x = x / 127.5 - 1.0
    if x[0].numel() != 64:
        raise ValueError(f"the digits metric expects 8x8 images, got shape {tuple(x.shape)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same bits whatever the caller's thread count
    try:
        features, logits = digits_classifier()(x.float().reshape(len(x), 64))
    finally:
        torch.set_num_threads(threads)
    return features.double().numpy(), logits.argmax(dim=1).numpy()


@lru_cache(maxsize=1)
def _reference() -> dict[str, object]:
    """Feature statistics of the real training digits and the real held-out scores."""
    x_train, _ = _split("train")
    x_held, y_held = _split("heldout")
    mu, sigma = feature_statistics(classify(x_train)[0])
    held_features, held_pred = classify(x_held)
    return {"mu": mu, "sigma": sigma, "real_heldout_acc": float((held_pred == y_held.numpy()).mean()),
            "real_heldout_fd": frechet_distance(*feature_statistics(held_features), mu, sigma, method="eigh")}


def digits_metric(features: np.ndarray, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """{digits_acc, digits_fd} of generated digits from their `classify` outputs and conditioning labels."""
    ref = _reference()
    labels = np.asarray(labels).reshape(-1)
    out = {"digits_acc": float((np.asarray(predictions) == labels).mean()), "digits_fd": float("nan")}
    if len(features) >= 2:
        out["digits_fd"] = frechet_distance(*feature_statistics(features), ref["mu"], ref["sigma"], method="eigh")
    return out


def digits_reference_scores() -> dict[str, float]:
    """What real held-out digits score: {real_heldout_acc, real_heldout_fd} (the metric's ceiling / floor)."""
    ref = _reference()
    return {"real_heldout_acc": ref["real_heldout_acc"], "real_heldout_fd": ref["real_heldout_fd"]}
