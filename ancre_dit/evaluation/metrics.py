"""FID / sFID, Inception Score and KID on precomputed features, with ADM's definitions.

Checked against guided-diffusion's evaluations/evaluator.py (ADM):
- Statistics: mu = mean, sigma = np.cov(rowvar=False) (ddof 1), accumulated in float64 (ADM's mean
  stays float32: differences ~1e-7 relative).
- Fréchet distance, method "sqrtm" (default, ADM's handling): scipy.linalg.sqrtm(sigma1 @ sigma2); if
  not finite, retry with 1e-6 added to both diagonals; a complex result whose diagonal has an
  imaginary part above 1e-3 is an error, otherwise its real part is used.
  Method "eigh": the same trace, tr sqrt(A sigma2 A) with A = sigma1^(1/2), from two symmetric
  eigendecompositions: faster, and stable with fewer samples than dimensions (where sqrtm of the
  singular product can fail); ~1e-6 relative from sqrtm on well-conditioned 50K statistics. With raw
  features of N < D images on one side it works in the N-dim sample space
  (`frechet_distance_to_features`): the nonzero eigenvalues of sigma1 sigma2 are those of
  Xc sigma2 Xc^T / (N - 1), Xc the centred features.
- Inception Score: softmax of the unbiased logits (pool_3 @ W, no bias) in consecutive splits of
  `split_size` images (ADM: 5000; the last may be smaller, as in ADM), exp(mean KL) per split, mean
  over splits, no shuffling (as ADM; torch-fidelity shuffles and uses a split count). float64
  log-softmax (torch-fidelity's isc_features_to_metric per split) where ADM takes np.log of a float32 softmax.
- KID (not in ADM): torch-fidelity's unbiased MMD with the cubic polynomial kernel on pool
  features, averaged over random subsets.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from ..errors import UserError

FID_METHODS = ("sqrtm", "eigh")


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) features -> mean (D,) and covariance (D, D) with ddof=1, in float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need at least 2 feature vectors (N, D) for a covariance, got shape {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


# scipy.linalg is imported where a distance is taken: every training process imports this module,
# and most never evaluate.
def _trace_sqrt_product_sqrtm(sigma1: np.ndarray, sigma2: np.ndarray, eps: float) -> float:
    from scipy import linalg

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
    return float(np.trace(covmean))


def _psd_eigenvalues(matrix: np.ndarray) -> np.ndarray:
    """Eigenvalues of a symmetric PSD matrix with rounding noise set to 0: the square root would
    blow noise of 1e-16 up to 1e-8 per eigenvalue, over thousands of null directions."""
    from scipy import linalg

    w = linalg.eigvalsh((matrix + matrix.T) / 2)
    w[w < max(w.max(), 0.0) * len(w) * np.finfo(np.float64).eps] = 0.0
    return w


def _trace_sqrt_product_eigh(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    from scipy import linalg

    w, v = linalg.eigh(sigma1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    return float(np.sqrt(_psd_eigenvalues(root1 @ sigma2 @ root1)).sum())


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
    tr_covmean = (_trace_sqrt_product_eigh(sigma1, sigma2) if method == "eigh"
                  else _trace_sqrt_product_sqrtm(sigma1, sigma2, eps))
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
