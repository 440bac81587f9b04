"""FID / sFID, Inception Score, KID, precision and recall on precomputed features, with the definitions
of ADM's evaluator (guided-diffusion evaluations/evaluator.py):
- Statistics: mu = mean, sigma = np.cov(rowvar=False) (ddof 1), in float64 (ADM's mean stays float32).
- Fréchet distance, method "sqrtm" (default, as ADM): scipy.linalg.sqrtm(sigma1 @ sigma2), retried with
  1e-6 added to both diagonals when not finite; an imaginary diagonal part above 1e-3 is an error, else
  the real part is used. Method "eigh": the same trace, tr sqrt(A sigma2 A) with A = sigma1^(1/2), from
  two symmetric eigendecompositions: faster, and stable with fewer samples than dimensions (where sqrtm
  of the singular product can fail). With raw features of N < D images on one side it works in the N-dim
  sample space (`frechet_distance_to_features`): the nonzero eigenvalues of sigma1 sigma2 are those of
  Xc sigma2 Xc^T / (N - 1), Xc the centred features.
- Inception Score: exp(mean KL) of the softmax of the unbiased logits (pool_3 @ W, no bias) in
  consecutive splits of `split_size` images (ADM: 5000; the last may be smaller; no shuffling, unlike
  torch-fidelity), averaged over splits; a float64 log-softmax (torch-fidelity's isc_features_to_metric
  per split) where ADM takes np.log of a float32 softmax.
- KID (not in ADM): torch-fidelity's unbiased MMD, cubic polynomial kernel on pool features.
- Improved precision and recall (Kynkäänniemi et al. 2019) as ADM's ManifoldEstimator: a vector's
  radius is the distance to its k-th nearest neighbour in its own set (itself the 0th); precision is the
  fraction of samples within some reference vector's radius, recall the converse; on Inception pool_3,
  distances in row x column blocks of `batch_size` (ADM: 10000). Squared distances in float32 (float64
  on the CPU for tiny sets) where ADM uses float16: radii tied at float16 resolution can flip a
  membership (4th decimal). Written here because torch-fidelity moves every distance block to the host.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from ..errors import UserError
from ..hardware import full_fp32

FID_METHODS = ("sqrtm", "eigh")


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) features -> mean (D,) and covariance (D, D) with ddof=1, in float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need at least 2 feature vectors (N, D) for a covariance, got shape {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


# scipy.linalg is imported where a distance is taken: every training process imports this module,
# and most never evaluate.
def _psd_eigenvalues(matrix: np.ndarray) -> np.ndarray:
    """Eigenvalues of a symmetric PSD matrix with rounding noise set to 0: the square root would
    blow noise of 1e-16 up to 1e-8 per eigenvalue, over thousands of null directions."""
    from scipy import linalg

    w = linalg.eigvalsh((matrix + matrix.T) / 2)
    w[w < max(w.max(), 0.0) * len(w) * np.finfo(np.float64).eps] = 0.0
    return w


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     method: str = "sqrtm", eps: float = 1e-6) -> float:
    """||mu1 - mu2||^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2)); see the module docstring."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (len(mu1), len(mu1)):
        raise UserError(f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs "
                        f"{sigma2.shape}; were they computed with the same features?")
    if method not in FID_METHODS:
        raise UserError(f"unknown Fréchet distance method {method!r}; choose one of {', '.join(FID_METHODS)}")
    from scipy import linalg

    if method == "eigh":
        w, v = linalg.eigh(sigma1)
        root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
        tr_covmean = float(np.sqrt(_psd_eigenvalues(root1 @ sigma2 @ root1)).sum())
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns on near-singular input; handled below as ADM does
            covmean = linalg.sqrtm(sigma1 @ sigma2)
        if not np.isfinite(covmean).all():
            warnings.warn(f"Fréchet distance: singular product, adding {eps} to the covariance diagonals (as ADM)")
            offset = np.eye(len(sigma1)) * eps
            covmean = linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
        if np.iscomplexobj(covmean):
            if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
                raise UserError(f"Fréchet distance: matrix square root has an imaginary component of "
                                f"{np.max(np.abs(covmean.imag)):.3g}; use more samples or --fid-method eigh")
            covmean = covmean.real
        tr_covmean = float(np.trace(covmean))
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)


def frechet_distance_to_features(features: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> float:
    """frechet_distance(*feature_statistics(features), mu, sigma, method="eigh"), computed in the
    N-dim sample space (O(N D^2)) when N <= D, where the D x D route is slow; else that route."""
    x = np.asarray(features, dtype=np.float64)
    mu, sigma = np.asarray(mu, np.float64), np.asarray(sigma, np.float64)
    if x.ndim != 2 or len(x) < 2 or x.shape[1] != len(mu) or sigma.shape != (len(mu), len(mu)):
        raise UserError(f"features {x.shape} do not match statistics mu {mu.shape}, sigma {sigma.shape}; were they "
                        "computed with the same feature network?")
    if len(x) > x.shape[1]:
        return frechet_distance(*feature_statistics(x), mu, sigma, method="eigh")
    centred = x - x.mean(axis=0)
    scale = 1.0 / (len(x) - 1)
    small = centred @ sigma @ centred.T * scale  # (N, N), same nonzero spectrum as sigma1 @ sigma
    tr_covmean = np.sqrt(_psd_eigenvalues(small)).sum()
    diff = x.mean(axis=0) - mu
    return float(diff @ diff + (centred * centred).sum() * scale + np.trace(sigma) - 2.0 * tr_covmean)


def inception_score(logits: np.ndarray, split_size: int = 5000) -> float:
    """ADM's IS: mean over consecutive splits of exp(E_x KL(p(y|x) || p(y))) on softmax(logits)."""
    from torch_fidelity.metric_isc import isc_features_to_metric

    logits = torch.as_tensor(np.asarray(logits))
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"inception_score needs (N, classes) logits, got shape {tuple(logits.shape)}")
    if split_size < 1:
        raise UserError(f"IS split size must be positive, got {split_size}")
    scores = [isc_features_to_metric(logits[i:i + split_size], splits=1, shuffle=False)["inception_score_mean"]
              for i in range(0, len(logits), split_size)]
    return float(np.mean(scores))


def kernel_inception_distance(real: np.ndarray, fake: np.ndarray, subsets: int = 100, subset_size: int = 1000,
                              seed: int = 0) -> tuple[float, float]:
    """KID mean and std (torch-fidelity's estimator); subsets shrink to the smaller set's size."""
    from torch_fidelity.metric_kid import kid_features_to_metric

    size = min(subset_size, len(real), len(fake))
    if size < 2:
        raise UserError("KID needs at least 2 images on each side")
    out = kid_features_to_metric(torch.as_tensor(np.asarray(fake, np.float64)),
                                 torch.as_tensor(np.asarray(real, np.float64)),
                                 kid_subsets=subsets, kid_subset_size=size, rng_seed=seed, verbose=False)
    return out["kernel_inception_distance_mean"], out["kernel_inception_distance_std"]


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
