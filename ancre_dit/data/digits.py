"""The embedded default data set: scikit-learn's 8x8 handwritten digits, in pixel space.

1,797 grayscale images (values 0..16) of 10 classes ship inside scikit-learn, so the default
needs no download and no VAE. Pixels are mapped linearly to [-1, 1]. A fixed, seeded,
stratified 10% of the images is held out ("heldout"); "train" is the rest, so every run and
every benchmark sees the same split.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UserError

DIGITS_NUM_CLASSES = 10
DIGITS_IMAGE_SIZE = 8
DIGITS_SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1
SPLIT_SEED = 0  # changing it changes every held-out number reported: keep it fixed
_MAX_PIXEL = 16.0


@lru_cache(maxsize=1)
def _split_indices() -> dict[str, np.ndarray]:
    """Indices of each split into load_digits()'s arrays (sorted, disjoint, covering all)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    labels = load_digits().target
    train, heldout = train_test_split(np.arange(len(labels)), test_size=HELDOUT_FRACTION,
                                      random_state=SPLIT_SEED, stratify=labels)
    return {"train": np.sort(train), "heldout": np.sort(heldout)}


@lru_cache(maxsize=1)
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


class DigitsDataset(Dataset):
    """Items are (image float32 (1, 8, 8) in [-1, 1], label int).

    `images` (N, 1, 8, 8) and `labels` (N,) hold the whole split as tensors, for loops that
    index batches directly instead of going through a DataLoader.
    """

    def __init__(self, split: str = "train"):
        if split not in DIGITS_SPLITS:
            raise UserError(f"unknown digits split {split!r}; choose one of {', '.join(DIGITS_SPLITS)}")
        images, labels = _all_digits()
        index = _split_indices()[split]
        self.split = split
        self.indices = index
        self.images = torch.from_numpy(images[index] / _MAX_PIXEL * 2.0 - 1.0).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(labels[index])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])
