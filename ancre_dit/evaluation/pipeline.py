"""Samples + reference -> FID, sFID, IS, precision, recall (+ KID), as ADM's evaluator scores them.

Each side (samples, reference) is an ADMBatch, an ADM .npz (images and/or mu, sigma, mu_s,
sigma_s) or a folder of images. As in ADM, statistics stored in an npz are used as they are for
FID / sFID; otherwise they come from the side's Inception features. IS uses the samples alone;
precision / recall and KID need the reference's images.

Differences from ADM's evaluator (guided-diffusion evaluations/evaluator.py), all checked there:
torch-fidelity's PyTorch port of the same Inception graph, float32 (inception.py); float64
statistics and log-softmax (metrics.py); float32 distances for precision / recall where ADM first
tries float16 (precision_recall.py); KID, which ADM lacks (torch-fidelity's estimator).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.adm_npz import ADMBatch
from ..data.image_folder import list_image_folder
from ..files import sha256_file
from .inception import InceptionExtractor, default_device, iterate_batches
from .metric_registry import (
    METRICS as METRIC_TABLE, MetricOptions, metric_entry, metric_names, reported_values, stored_stat_keys, value_label,
)
from .image_sets import Side
from .sources import ImageFolderBatches, open_adm_npz
from ..errors import UserError

_log = logging.getLogger("ancre_dit")

# From the metric table: what evaluate.py offers, and its default (ADM's five).
METRICS = metric_names(evaluate=True)
ADM_METRICS = DEFAULT_METRICS = metric_names(default=True)


_EXTRACTORS: dict[tuple, InceptionExtractor] = {}


def get_extractor(weights: str | os.PathLike, device: str | torch.device | None = None) -> InceptionExtractor:
    """A loaded extractor, cached per (weights file, its mtime, device) so repeated calls reuse it."""
    device = torch.device(device) if device is not None else default_device()
    path = Path(weights)
    key = (str(path.resolve()), path.stat().st_mtime_ns if path.is_file() else None, str(device))
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()  # one network in memory at a time
        _EXTRACTORS[key] = InceptionExtractor(path, device)
    return _EXTRACTORS[key]


def default_batch_size(device: torch.device) -> int:
    return 250 if device.type == "cuda" else 32


def load_side(source: ADMBatch | str | os.PathLike, name: str, extractor_fn, batch_size: int,
              need_features: bool, image_size: int | None = None, workers: int = 0) -> Side:
    """Reads a side and, when needed (`need_features`) and possible, extracts its Inception features.
    `extractor_fn()` loads the network lazily, so a statistics-only run never needs it twice."""
    if isinstance(source, ADMBatch):
        batch, label = source, name
    else:
        path = Path(source)
        label = f"{name} ({path})"
        if path.is_dir():
            files = list_image_folder(path).paths()
            side = Side(label, num_images=len(files), image_size=image_size)
            if need_features:
                batches = ImageFolderBatches(files, image_size, batch_size, workers)
                side.features = extractor_fn().extract(batches, total=len(files), desc=f"inception: {name}")
            return side
        batch = open_adm_npz(path)
    side = Side(label, stats=dict(batch.stats), num_images=0 if batch.images is None else len(batch.images),
                stats_source="stored" if batch.stats else "features",
                image_size=None if batch.images is None else int(batch.images.shape[1]))
    if batch.images is not None and len(batch.images) == 0 and (need_features or not side.stats):
        raise UserError(f"{label} holds no images to evaluate (arr_0 is empty); pass an .npz with samples")
    if batch.images is not None and need_features:
        side.features = extractor_fn().extract(iterate_batches(batch.images, batch_size), total=len(batch.images),
                                               desc=f"inception: {name}")
    return side


@dataclass
class EvaluationResult:
    metrics: dict[str, float]
    info: dict[str, object]


def score(samples, ref, metrics=DEFAULT_METRICS, **options) -> dict[str, float]:
    """The requested metrics, all on one feature network, from its two prepared sides (see metric_registry);
    `options`: MetricOptions' fields."""
    settings = MetricOptions(**options)
    out: dict[str, float] = {}
    for metric in metrics:
        if metric not in out:  # one function may give several values (precision gives recall too)
            out.update(metric_entry(metric).compute(samples, ref, settings))
    wanted = reported_values(metrics)
    return {k: v for k, v in out.items() if k in wanted}


def parse_metrics(metrics: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = [m.strip().lower() for m in (metrics.split(",") if isinstance(metrics, str) else metrics) if m.strip()]
    offered = metric_names(evaluate=True)
    unknown = [m for m in names if m not in offered]
    if unknown or not names:
        raise UserError(f"unknown metric(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(offered)}")
    return tuple(dict.fromkeys(names))


def evaluate(samples: ADMBatch | str | os.PathLike, ref: ADMBatch | str | os.PathLike | None,
             weights: str | os.PathLike, metrics=DEFAULT_METRICS, batch_size: int | None = None,
             device: str | torch.device | None = None, is_split_size: int = 5000, pr_k: int = 3,
             fid_method: str = "sqrtm", kid_subsets: int = 100, kid_subset_size: int = 1000,
             image_size: int | None = None, workers: int = 0,
             dinov2_weights: str | os.PathLike | None = None, dinov2_model: str | None = None) -> EvaluationResult:
    """Scores `samples` against `ref` (None is allowed when only IS is asked for); returns the metrics
    and what they were computed from (sample count, reference, weights file and its sha256, settings).
    fd_dinov2 needs `dinov2_weights` (a timm file of `dinov2_model`) and no Inception weights."""
    metrics = parse_metrics(metrics)
    device = torch.device(device) if device is not None else default_device()
    on_dinov2 = tuple(m for m in metrics if METRIC_TABLE[m].features == "dinov2")
    if on_dinov2:
        dinov2 = _dinov2_metrics(on_dinov2, samples, ref, dinov2_weights, dinov2_model,
                                 batch_size or default_batch_size(device), device, fid_method, image_size, workers)
        rest = tuple(m for m in metrics if m not in on_dinov2)
        if not rest:
            return dinov2
        result = evaluate(samples, ref, weights, rest, batch_size, device, is_split_size, pr_k, fid_method, kid_subsets,
                          kid_subset_size, image_size, workers)
        return EvaluationResult({**result.metrics, **dinov2.metrics}, {**result.info, **dinov2.info})
    batch_size = batch_size or default_batch_size(device)
    start = time.time()
    extractor_fn = lambda: get_extractor(weights, device)  # noqa: E731
    ref_metrics = [m for m in metrics if METRIC_TABLE[m].needs != "features"]  # IS looks at the samples alone
    if ref_metrics and ref is None:
        raise UserError(f"{', '.join(ref_metrics)} need a reference (--ref)")
    image_metrics = [m for m in metrics if METRIC_TABLE[m].needs == "reference images"]
    members = _npz_members(ref) if image_metrics and ref is not None else None
    if members is not None and "arr_0" not in members:
        raise UserError(f"{', '.join(image_metrics)} need reference images but {ref} holds statistics only "
                         f"(no arr_0); pass a reference with images, or drop them from --metrics")
    extractor_fn()  # fail on bad weights before reading 50K images
    if ref is not None:  # an empty or unreadable reference is found before the samples' features
        _check_readable(ref)
    sample_side = load_side(samples, "samples", extractor_fn, batch_size, need_features=True, workers=workers)
    if ref is None:
        ref_side = Side("reference (none)", stats_source="none")
    else:
        ref_needs = bool(image_metrics) or not has_stored_stats(ref, ref_metrics)
        ref_side = load_side(ref, "reference", extractor_fn, batch_size, need_features=ref_needs,
                             image_size=image_size or sample_side.image_size, workers=workers)
    if ref_metrics and sample_side.image_size and ref_side.image_size and sample_side.image_size != ref_side.image_size:
        _log.warning("warning: the samples are %dx%d but the reference images %dx%d: Inception resizes both to 299, "
                     "which hides the difference; FID against a reference of another resolution is not comparable "
                     "with published numbers", sample_side.image_size, sample_side.image_size, ref_side.image_size,
                     ref_side.image_size)
    values = score(sample_side, ref_side, metrics, is_split_size=is_split_size, pr_k=pr_k, fid_method=fid_method,
                   kid_subsets=kid_subsets, kid_subset_size=kid_subset_size, device=device)
    extractor = extractor_fn()
    import torch_fidelity

    settings = {"is_split_size": is_split_size, "pr_k": pr_k, "fid_method": fid_method, "batch_size": batch_size,
                "device": str(device),
                **({"kid_subsets": kid_subsets, "kid_subset_size": kid_subset_size} if "kid" in metrics else {})}
    info = {"num_samples": sample_side.num_images, "num_reference_images": ref_side.num_images,
            "samples": _describe(samples), "reference": _describe(ref), "reference_statistics": ref_side.stats_source,
            "inception_weights": str(Path(extractor.weights).resolve()),
            "inception_weights_sha256": sha256_file(extractor.weights),
            "feature_extractor": f"torch-fidelity {torch_fidelity.__version__} inception-v3-compat",
            "settings": settings, "seconds": round(time.time() - start, 1)}
    return EvaluationResult(values, info)


def _dinov2_metrics(metrics: tuple[str, ...], samples, ref, weights, model, batch_size: int, device: torch.device,
                    fid_method: str, image_size: int | None, workers: int) -> EvaluationResult:
    """The DINOv2 metrics of `samples` against `ref` (its stored statistics, else its images)."""
    from .dinov2 import DINOV2_MODEL, get_dinov2_extractor

    if ref is None:
        raise UserError(f"{', '.join(metrics)} needs a reference (--ref)")
    model = model or DINOV2_MODEL
    extractor = get_dinov2_extractor(weights, model, device)  # fail on bad weights before reading images
    start = time.time()
    feats = dinov2_features(samples, extractor, batch_size, None, workers, "samples")
    ref_batch = _open_npz(ref)
    keys = stored_stat_keys(metrics)
    if ref_batch is not None and set(keys) <= set(ref_batch.stats):
        reference, source = tuple(ref_batch.stats[k] for k in keys), "stored"
    else:
        batch = _open_npz(samples)  # a folder reference is cropped to the samples' size
        size = image_size or (None if batch is None or batch.images is None else int(batch.images.shape[1]))
        reference = dinov2_features(ref if ref_batch is None else ref_batch, extractor, batch_size, size, workers,
                                    "reference")
        source = "features"
    values = score(feats, reference, metrics, fid_method=fid_method, device=device)
    info = {"num_samples": len(feats), "samples": _describe(samples), "reference": _describe(ref),
            "dinov2_model": model, "dinov2_weights": str(Path(weights).resolve()),
            "dinov2_weights_sha256": sha256_file(weights), "dinov2_reference_statistics": source,
            "dinov2_seconds": round(time.time() - start, 1)}
    return EvaluationResult(values, info)


def _open_npz(source) -> ADMBatch | None:
    """An ADMBatch as it is, an npz opened (see open_adm_npz); None for a folder."""
    return source if isinstance(source, ADMBatch) else (open_adm_npz(source) if Path(source).is_file() else None)


def dinov2_features(source, extractor, batch_size: int, image_size: int | None = None, workers: int = 0,
                    name: str = "images") -> np.ndarray:
    """DINOv2 CLS features of every image of an ADMBatch, an npz or a folder (centre-cropped to
    `image_size`, as the Inception path reads folders)."""
    if not isinstance(source, ADMBatch) and Path(source).is_dir():
        files = list_image_folder(source).paths()
        return extractor.extract(ImageFolderBatches(files, image_size, batch_size, workers), len(files),
                                 desc=f"dinov2: {name}")
    batch = source if isinstance(source, ADMBatch) else open_adm_npz(source)
    if batch.images is None:
        raise UserError(f"fd_dinov2 needs images of the {name} (arr_0) or its stored mu_dinov2 / sigma_dinov2 "
                        "(evaluate.py --save-ref-stats ... --dinov2-weights FILE)")
    return extractor.extract(iterate_batches(batch.images, batch_size), len(batch.images), desc=f"dinov2: {name}")


def compute_metrics(samples: ADMBatch | str | os.PathLike, ref: str | os.PathLike | ADMBatch | None,
                    weights: str | os.PathLike, metrics=DEFAULT_METRICS, batch_size: int | None = None,
                    device: str | torch.device | None = None, **options) -> dict[str, float]:
    """FID / sFID / IS / precision / recall / KID of `samples` against `ref` (see `evaluate` for options).
    Keys: the requested metric names ('fid', 'sfid', 'is', 'precision', 'recall', 'kid' + 'kid_std')."""
    return evaluate(samples, ref, weights, metrics, batch_size, device, **options).metrics


def _npz_members(source) -> set[str] | None:
    """What an ADMBatch or an npz holds ("arr_0" for its images, its statistics' keys); None for a
    folder (or a missing path: reading it gives the clear error)."""
    if isinstance(source, ADMBatch):
        return set(source.stats) | ({"arr_0"} if source.images is not None else set())
    if Path(source).is_file():
        with np.load(source) as data:
            return set(data.files)
    return None


def has_stored_stats(ref, metrics) -> bool:
    """Does `ref` (a path or an ADMBatch) carry every statistic the given metrics can use instead of its images?"""
    members = _npz_members(ref)
    return members is not None and set(stored_stat_keys(metrics)) <= members


def _check_readable(ref) -> None:
    """The cheap part of load_side (a folder's listing, an npz's header): raises what reading `ref` would."""
    if isinstance(ref, ADMBatch):
        return
    if Path(ref).is_dir():
        list_image_folder(ref)
    elif (batch := open_adm_npz(ref)).images is not None and len(batch.images) == 0 and not batch.stats:
        raise UserError(f"reference ({Path(ref)}) holds no images to evaluate (arr_0 is empty); pass another --ref")


def display(value: float) -> str:
    """A metric as printed: 4 decimals, and never "-0.0000" (a tiny negative rounding error)."""
    text = f"{value:.4f}"
    return "0.0000" if text == "-0.0000" else text


def _describe(source) -> str | None:
    if source is None:
        return None
    if isinstance(source, ADMBatch):
        return f"in-memory batch of {0 if source.images is None else len(source.images)} images"
    return str(Path(source).resolve())


def format_table(result: EvaluationResult) -> str:
    """Results as an aligned two-column text table, with the sample count and reference."""
    rows = [(value_label(k), display(v)) for k, v in result.metrics.items()]
    info = result.info
    rows += [("samples", str(info.get("num_samples", "-"))),
             ("reference", str(info.get("reference") or "none (IS only)")),
             ("reference stats", str(info.get("reference_statistics", info.get("dinov2_reference_statistics"))))]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
