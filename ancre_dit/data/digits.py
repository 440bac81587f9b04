"""The embedded default data set: scikit-learn's 8x8 handwritten digits, in pixel space.

1,797 grayscale images (values 0..16) of 10 classes ship inside scikit-learn: no download, no VAE.
Pixels are mapped linearly to [-1, 1]. A fixed, seeded, stratified 10% is held out ("heldout"), "train"
is the rest, so every run and every benchmark sees the same split.
"""
from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UserError

DIGITS_NUM_CLASSES = 10
DIGITS_IMAGE_SIZE = 8
DIGITS_SPLITS = ("train", "heldout")
_MAX_PIXEL = 16.0

# The held-out 10%: scikit-learn's train_test_split(arange(1797), test_size=0.1, random_state=0, stratify=labels),
# sorted; written out since importing scikit-learn slows start-up (tests/test_digits.py checks it). Keep it fixed:
# every held-out number reported depends on it.
HELDOUT_INDICES = tuple(int(i) for i in """
    24 28 35 37 39 57 77 78 87 99 102 103 105 110 131 132 148 159 170 186 188 197 202 211 214 245 252 283
    293 308 312 335 344 364 372 374 376 386 393 397 405 407 413 417 430 440 442 452 454 500 520 565 569 573
    587 593 608 619 639 641 649 652 666 675 694 700 701 702 716 719 738 741 749 760 767 768 770 772 787 788
    789 800 802 805 806 820 822 854 855 876 885 899 908 918 926 937 945 985 997 1003 1009 1023 1049 1073 1081
    1090 1096 1107 1108 1116 1121 1123 1136 1148 1151 1161 1162 1168 1173 1180 1187 1204 1220 1232 1233 1242
    1261 1264 1268 1270 1292 1312 1319 1330 1331 1350 1351 1352 1364 1371 1405 1415 1482 1484 1497 1505 1509
    1513 1520 1566 1567 1596 1602 1608 1610 1614 1617 1634 1645 1650 1655 1660 1664 1666 1673 1696 1703 1716
    1717 1726 1728 1734 1742 1750 1755 1767 1772 1781 1787 1789""".split())


@lru_cache(maxsize=1)
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (1797, 8, 8) in 0..16, labels int64), as sklearn's load_digits gives them, read from
    the file scikit-learn ships without importing it (slow); load_digits itself where that file is not."""
    sklearn = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(sklearn.origin).parent / "datasets" / "data" / "digits.csv.gz" if sklearn and sklearn.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.images.astype(np.float32), data.target.astype(np.int64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8).astype(np.float32), table[:, -1].astype(np.int64)


class DigitsDataset(Dataset):
    """Items are (image float32 (1, 8, 8) in [-1, 1], label int); `images` (N, 1, 8, 8) and `labels` (N,)
    hold the whole split as tensors, for loops that index batches directly instead of using a DataLoader."""

    def __init__(self, split: str = "train"):
        if split not in DIGITS_SPLITS:
            raise UserError(f"unknown digits split {split!r}; choose one of {', '.join(DIGITS_SPLITS)}")
        images, labels = _all_digits()
        heldout = np.asarray(HELDOUT_INDICES, dtype=np.int64)
        self.indices = heldout if split == "heldout" else np.setdiff1d(np.arange(len(labels)), heldout)
        self.images = torch.from_numpy(images[self.indices] / _MAX_PIXEL * 2.0 - 1.0).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(labels[self.indices])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])
