"""Which class each sample gets: balanced (default), drawn at random, or a user list cycled.

Every rule gives sample i a label that depends only on (seed, i), like its noise.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UserError
from .noise import LABEL_STREAM, sample_seed

LABEL_MODES = ("balanced", "random")


def check_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    if not classes:
        raise UserError("--classes is empty; give class ids such as --classes 1,2,3")
    bad = [c for c in classes if not 0 <= int(c) < num_classes]
    if bad:
        raise UserError(f"class id(s) {', '.join(map(str, bad))} out of range: this model has {num_classes} "
                        f"classes, ids 0..{num_classes - 1}")
    return [int(c) for c in classes]


def assign_labels(indices: Sequence[int] | np.ndarray, num_classes: int, *, seed: int = 0, mode: str = "balanced",
                  classes: Sequence[int] | None = None) -> np.ndarray:
    """int64 labels of the given sample indices.

    classes given (ids checked by `check_classes` at the caller's edge): sample i gets
    classes[i % len(classes)]. Otherwise "balanced": class i % num_classes
    (so N = 50 x num_classes gives exactly 50 per class, and any prefix is balanced to within one);
    "random": uniform, from sample i's own label stream.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if classes is not None:
        table = np.asarray(classes, dtype=np.int64)
        return table[indices % len(table)]
    if mode == "balanced":
        return indices % num_classes
    if mode == "random":
        return np.array([np.random.default_rng(sample_seed(seed, i, LABEL_STREAM)).integers(num_classes)
                         for i in indices], dtype=np.int64)
    raise UserError(f"unknown label mode {mode!r}; choose {' or '.join(LABEL_MODES)}")
