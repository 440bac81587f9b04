"""Per-sample random streams and class labels, so that sample i depends only on (seed, i).

Each sample owns a CPU torch.Generator seeded from (seed, i); its initial noise and every
per-step noise are drawn from that generator in a fixed order. A sample therefore comes out the
same whatever the batch size, the number of processes or the other samples in its batch. Its
label is balanced (default), drawn from its own label stream, or taken from a user list cycled.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import UserError

# Stream ids, so that labels and noise drawn for the same (seed, i) are independent.
NOISE_STREAM = 0
LABEL_STREAM = 1


def sample_seed(seed: int, index: int, stream: int = NOISE_STREAM) -> int:
    """A well-mixed 63-bit seed for sample `index` of a job seeded `seed` (SeedSequence hashing,
    not seed + index, so that neighbouring jobs do not share streams)."""
    state = np.random.SeedSequence([int(seed), int(index), int(stream)]).generate_state(1, np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


class SampleNoise:
    """Standard normal noise of shape `shape` per sample, one generator per sample index."""

    def __init__(self, seed: int, indices: Sequence[int], shape: Sequence[int], device: torch.device | str = "cpu"):
        self.shape = tuple(int(s) for s in shape)
        self.device = torch.device(device)
        self.generators = [torch.Generator(device="cpu").manual_seed(sample_seed(seed, int(i))) for i in indices]

    def next(self) -> torch.Tensor:
        """The next draw of every sample, stacked: (N, *shape) float32 on `device`; drawn on the CPU
        (cheap next to a network forward) so that a sample is identical on any device."""
        return torch.stack([torch.randn(self.shape, generator=g) for g in self.generators]).to(self.device)


def check_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    """The user's class ids as ints, each checked against the model's class count."""
    if not classes:
        raise UserError("--classes is empty; give class ids such as --classes 1,2,3")
    bad = [c for c in classes if not 0 <= int(c) < num_classes]
    if bad:
        raise UserError(f"class id(s) {', '.join(map(str, bad))} out of range: this model has {num_classes} "
                        f"classes, ids 0..{num_classes - 1}")
    return [int(c) for c in classes]


def assign_labels(indices: Sequence[int] | np.ndarray, num_classes: int, *, seed: int = 0, mode: str = "balanced",
                  classes: Sequence[int] | None = None) -> np.ndarray:
    """int64 labels of the given sample indices: classes[i % len(classes)] when classes are given
    (checked by the caller); else "balanced", class i % num_classes (N = 50 x num_classes gives exactly
    50 per class, any prefix is balanced to within one), or "random", uniform from i's label stream."""
    indices = np.asarray(indices, dtype=np.int64)
    if classes is not None:
        table = np.asarray(classes, dtype=np.int64)
        return table[indices % len(table)]
    if mode == "balanced":
        return indices % num_classes
    if mode == "random":
        return np.array([np.random.default_rng(sample_seed(seed, i, LABEL_STREAM)).integers(num_classes)
                         for i in indices], dtype=np.int64)
    raise UserError(f"unknown label mode {mode!r}; choose balanced or random")
