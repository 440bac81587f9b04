"""Per-sample random streams, so that sample i depends only on (seed, i).

Each sample owns a CPU torch.Generator seeded from (seed, i); its initial noise and every
per-step noise are drawn from that generator in a fixed order. A sample therefore comes out the
same whatever the batch size, the number of processes or the other samples in its batch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

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
        self.generators = []
        for i in indices:
            g = torch.Generator(device="cpu")
            g.manual_seed(sample_seed(seed, int(i)))
            self.generators.append(g)

    def __len__(self) -> int:
        return len(self.generators)

    def next(self) -> torch.Tensor:
        """The next draw of every sample, stacked: (N, *shape) float32 on `device`.

        Drawn on the CPU (cheap next to a network forward) so a sample is identical on any device.
        """
        noise = torch.stack([torch.randn(self.shape, generator=g) for g in self.generators])
        return noise.to(self.device)
