"""Improved precision and recall (Kynkäänniemi et al. 2019) as ADM's ManifoldEstimator computes them.

Checked against guided-diffusion's evaluations/evaluator.py: each feature vector's radius is the
distance to its k-th nearest neighbour in its own set, itself the 0th (k = 3: the 4th smallest
distance); precision is the fraction of sample features within the radius of some reference
feature, recall the converse; features are Inception pool_3 (not torch-fidelity's VGG16); distances
come in row x column blocks of `batch_size` (ADM: 10000 x 10000).
Where ADM compares squared distances in float16 (float32 when that overflows), we use float32 (or
float64 on the CPU for tiny test sets): radii tied at float16 resolution can flip a membership, so
values may differ from ADM's in the 4th decimal. Written by hand because torch-fidelity's
calculate_precision_recall_part moves every distance block to the host; here blocks stay on the GPU.
"""
from __future__ import annotations

import numpy as np
import torch
from ..errors import UserError
from ..hardware import full_fp32


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # ||a||^2 - 2ab + ||b||^2 as ADM (one matmul), clamped at 0 against rounding.
    d = (a * a).sum(1, keepdim=True) - 2.0 * a @ b.T + (b * b).sum(1)[None, :]
    return d.clamp_min_(0.0)


def manifold_radii(features: torch.Tensor, k: int = 3, batch_size: int = 10000) -> torch.Tensor:
    """Squared distance of each vector to its k-th nearest neighbour (itself being the 0th)."""
    n = len(features)
    if n <= k:
        raise UserError(f"precision/recall with k={k} needs more than {k} images per set, got {n}")
    radii = []
    for start in range(0, n, batch_size):
        rows = features[start:start + batch_size]
        d = torch.cat([_squared_distances(rows, features[c:c + batch_size]) for c in range(0, n, batch_size)], 1)
        radii.append(d.kthvalue(k + 1, dim=1).values)
    return torch.cat(radii)


def _covered(points: torch.Tensor, centers: torch.Tensor, radii: torch.Tensor, batch_size: int) -> torch.Tensor:
    """For each point: is it within (<=) some center's radius? (bool, on the device)."""
    flags = []
    for start in range(0, len(points), batch_size):
        rows = points[start:start + batch_size]
        hit = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
        for c in range(0, len(centers), batch_size):
            d = _squared_distances(rows, centers[c:c + batch_size])
            hit |= (d <= radii[None, c:c + batch_size]).any(1)
        flags.append(hit)
    return torch.cat(flags)


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = 3, batch_size: int = 10000,
                     device: str | torch.device | None = None, dtype: torch.dtype = torch.float32
                     ) -> tuple[float, float]:
    """(precision, recall) of `fake` (samples) against `real` (reference) feature vectors."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    real_t = torch.as_tensor(np.asarray(real), dtype=dtype, device=device)
    fake_t = torch.as_tensor(np.asarray(fake), dtype=dtype, device=device)
    if real_t.ndim != 2 or fake_t.ndim != 2 or real_t.shape[1] != fake_t.shape[1]:
        raise ValueError(f"precision/recall needs (N, D) features of one D, got {tuple(real_t.shape)} "
                         f"and {tuple(fake_t.shape)}")
    with full_fp32():  # the distances' matmuls: TF32 would move points across a radius
        real_radii = manifold_radii(real_t, k, batch_size)
        fake_radii = manifold_radii(fake_t, k, batch_size)
        precision = _covered(fake_t, real_t, real_radii, batch_size).double().mean().item()
        recall = _covered(real_t, fake_t, fake_radii, batch_size).double().mean().item()
    return precision, recall
