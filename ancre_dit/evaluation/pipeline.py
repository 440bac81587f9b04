"""Samples + reference -> FID, sFID, IS, precision, recall (+ KID, FD-DINOv2), as ADM's evaluator
(guided-diffusion evaluations/evaluator.py) scores them; and a reference's statistics from a folder of
real images.

Each side (samples, reference) is an ADMBatch, an ADM .npz (images and/or mu, sigma, mu_s, sigma_s)
or a folder of images (listed and read by ancre_dit.data.image_folder). As in ADM, statistics stored
in an npz are used as they are for FID / sFID; otherwise they come from the side's Inception features.
IS uses the samples alone; precision / recall and KID need the reference's images. Where the numbers
differ from ADM's: see inception.py and metrics.py.

50K samples at 256x256 are 9.8 GB of uint8: `open_adm_npz` memory-maps `arr_0` when the npz stores it
uncompressed (np.savez, what sample.py and ADM write), so features are computed batch by batch.
"""
from __future__ import annotations

import logging
import os
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..data.adm_npz import STAT_KEYS, ADMBatch, check_labels, check_stats, load_adm_npz, save_adm_npz
from ..data.image_folder import list_image_folder, load_rgb
from ..errors import UserError
from ..files import sha256_file
from .inception import InceptionExtractor, default_device, iterate_batches, loaded
from .metric_registry import (
    METRICS as METRIC_TABLE, MetricOptions, Side, metric_entry, metric_names, reported_values, stored_stat_keys,
    value_label,
)
from .metrics import feature_statistics

_log = logging.getLogger("ancre_dit")

# From the metric table: what evaluate.py offers, and its default (ADM's five).
METRICS = metric_names(evaluate=True)
ADM_METRICS = DEFAULT_METRICS = metric_names(default=True)


def default_batch_size(device: torch.device) -> int:
    return 250 if device.type == "cuda" else 32


def _memmap_member(path: Path, member: str) -> np.ndarray | None:
    """A read-only memmap of `member` (.npy) inside an uncompressed zip, or None if not possible
    (numpy's mmap_mode is ignored for .npz files)."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            return None
        if info.compress_type != zipfile.ZIP_STORED:
            return None
        # The local header (30 bytes + name + extra; its extra may differ from the central one).
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            return None
        if fortran or dtype.hasobject:
            return None
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def open_adm_npz(path: str | os.PathLike) -> ADMBatch:
    """Like load_adm_npz, but `images` is a memmap (uint8, (N, H, W[, 1|3])) when possible;
    consumers convert each batch with to_rgb_uint8."""
    path = Path(path)
    try:
        images = _memmap_member(path, "arr_0.npy")
    except (OSError, zipfile.BadZipFile, ValueError):
        images = None
    if images is None or images.dtype != np.uint8 or images.ndim not in (3, 4):
        return load_adm_npz(path)  # compressed, odd, or broken: its reader gives the clear errors
    if images.ndim == 4 and images.shape[-1] not in (1, 3):
        raise UserError(f"{path}: arr_0 holds images of shape {tuple(images.shape)}; ADM images are (N, H, W[, 1|3]) "
                        f"uint8: {_layout_fix(images.shape)}, and save again")
    with np.load(path) as data:
        labels = check_labels(data["arr_1"], len(images), path) if "arr_1" in data.files else None
        stats = {k: data[k] for k in STAT_KEYS if k in data.files}
    check_stats(stats, path)
    return ADMBatch(images, labels, stats)


def _layout_fix(shape: tuple[int, ...]) -> str:
    """What turns an (N, ?, ?, ?) array into ADM's (N, H, W, C) one."""
    if shape[1] in (1, 3, 4):
        return "it looks channels-first (N, C, H, W): transpose it, images.transpose(0, 2, 3, 1)"
    if shape[-1] == 4:
        return "drop the alpha channel, images[..., :3]"
    return f"{shape[-1]} is not a channel count of RGB or grayscale images"


class ImageFolderBatches:
    """Batches of center-cropped uint8 images read from files, decoded by DataLoader workers."""

    def __init__(self, files: list[Path], image_size: int | None, batch_size: int, workers: int = 0):
        self.files, self.image_size, self.batch_size, self.workers = files, image_size, batch_size, workers

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> np.ndarray:
        image = load_rgb(self.files[i], self.image_size)
        if self.image_size is None and i > 0 and image.shape != self.first_shape:
            raise UserError(f"{self.files[i]} is {image.shape[:2]}, not {self.first_shape[:2]} like the first "
                             f"image; pass an image size so every image is center-cropped to one size")
        return image

    def __iter__(self) -> Iterator[np.ndarray]:
        from torch.utils.data import DataLoader

        self.first_shape = load_rgb(self.files[0], self.image_size).shape  # read once, before workers start
        yield from DataLoader(self, batch_size=self.batch_size, num_workers=self.workers, collate_fn=np.stack)


def open_side(source: ADMBatch | str | os.PathLike, name: str, image_size: int | None = None,
              fix: str = "pass an .npz with samples") -> Side:
    """A side without its features: its label, stored statistics, image count and size (a folder's
    images are center-cropped to `image_size`) and what holds its images (an ADMBatch, given or an npz
    opened by open_adm_npz, or a folder's image files). arr_0 empty with no statistics is an error ending in `fix`."""
    if isinstance(source, ADMBatch):
        label, batch = name, source
    else:
        path = Path(source)
        label = f"{name} ({path})"
        if path.is_dir():
            files = list_image_folder(path).paths()
            return Side(label, num_images=len(files), image_size=image_size, images=files)
        batch = open_adm_npz(path)
    images = batch.images
    if images is not None and len(images) == 0 and not batch.stats:
        raise UserError(f"{label} holds no images to evaluate (arr_0 is empty); {fix}")
    return Side(label, stats=dict(batch.stats), num_images=0 if images is None else len(images),
                stats_source="stored" if batch.stats else "features",
                image_size=None if images is None else int(images.shape[1]), images=images)


def side_features(side: Side, extractor, batch_size: int, desc: str, workers: int = 0):
    """`extractor.extract` (Inception's or DINOv2's) over the side's images, read batch by batch; None
    when it has none."""
    if side.images is None:
        return None
    if side.num_images == 0:  # arr_0 empty beside stored statistics, which do not stand in for what needs images
        raise UserError(f"{side.name} holds no images to evaluate (arr_0 is empty); pass an .npz with images")
    if isinstance(side.images, list):
        batches = ImageFolderBatches(side.images, side.image_size, batch_size, workers)
    else:
        batches = iterate_batches(side.images, batch_size)
    return extractor.extract(batches, total=side.num_images, desc=desc)


def reference_features(side: Side, metrics, extractor, batch_size: int, workers: int = 0) -> Side:
    """Adds the reference's Inception features when `metrics` need its images, or statistics it does not store."""
    if (any(METRIC_TABLE[m].needs == "reference images" for m in metrics)
            or not set(stored_stat_keys(metrics)) <= set(side.stats)):
        side.features = side_features(side, extractor, batch_size, "inception: reference", workers)
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
    batch_size = batch_size or default_batch_size(device)
    on_dinov2 = tuple(m for m in metrics if METRIC_TABLE[m].features == "dinov2")
    dinov2 = EvaluationResult({}, {})
    if on_dinov2:
        dinov2 = _dinov2_metrics(on_dinov2, samples, ref, dinov2_weights, dinov2_model, batch_size, device,
                                 fid_method, image_size, workers)
        metrics = tuple(m for m in metrics if m not in on_dinov2)
        if not metrics:
            return dinov2
    start = time.time()
    ref_metrics = [m for m in metrics if METRIC_TABLE[m].needs != "features"]  # IS looks at the samples alone
    if ref_metrics and ref is None:
        raise UserError(f"{', '.join(ref_metrics)} need a reference (--ref)")
    extractor = loaded(InceptionExtractor, weights, device)  # fail on bad weights before reading 50K images
    sample_side = open_side(samples, "samples")
    ref_side = Side("reference (none)", stats_source="none")
    if ref is not None:  # an empty or unreadable reference is found before the samples' features
        ref_side = open_side(ref, "reference", image_size or sample_side.image_size, fix="pass another --ref")
    image_metrics = [m for m in metrics if METRIC_TABLE[m].needs == "reference images"]
    if image_metrics and ref_side.images is None:
        raise UserError(f"{', '.join(image_metrics)} need reference images but {ref} holds statistics only "
                         f"(no arr_0); pass a reference with images, or drop them from --metrics")
    sample_side.features = side_features(sample_side, extractor, batch_size, "inception: samples", workers)
    if ref is not None:
        reference_features(ref_side, ref_metrics, extractor, batch_size, workers)
    if ref_metrics and sample_side.image_size and ref_side.image_size and sample_side.image_size != ref_side.image_size:
        _log.warning("warning: the samples are %dx%d but the reference images %dx%d: Inception resizes both to 299, "
                     "which hides the difference; FID against a reference of another resolution is not comparable "
                     "with published numbers", sample_side.image_size, sample_side.image_size, ref_side.image_size,
                     ref_side.image_size)
    values = score(sample_side, ref_side, metrics, is_split_size=is_split_size, pr_k=pr_k, fid_method=fid_method,
                   kid_subsets=kid_subsets, kid_subset_size=kid_subset_size, device=device)
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
    return EvaluationResult({**values, **dinov2.metrics}, {**info, **dinov2.info})


def _dinov2_metrics(metrics: tuple[str, ...], samples, ref, weights, model, batch_size: int, device: torch.device,
                    fid_method: str, image_size: int | None, workers: int) -> EvaluationResult:
    """The DINOv2 metrics of `samples` against `ref` (its stored statistics, else its images)."""
    from .dinov2 import DINOV2_MODEL, DinoV2Extractor  # timm: only where DINOv2 runs

    if ref is None:
        raise UserError(f"{', '.join(metrics)} needs a reference (--ref)")
    model = model or DINOV2_MODEL
    extractor = loaded(DinoV2Extractor, weights, model, device)  # fail on bad weights before reading images
    start = time.time()
    sample_side = open_side(samples, "samples")
    feats = dinov2_features(sample_side, extractor, batch_size, "samples", workers)
    # A folder reference is cropped to the samples' size.
    ref_side = open_side(ref, "reference", image_size or sample_side.image_size, fix="pass another --ref")
    reference, source = dinov2_reference(ref_side, extractor, batch_size, workers)
    values = score(feats, reference, metrics, fid_method=fid_method, device=device)
    info = {"num_samples": len(feats), "samples": _describe(samples), "reference": _describe(ref),
            "dinov2_model": model, "dinov2_weights": str(Path(weights).resolve()),
            "dinov2_weights_sha256": sha256_file(weights), "dinov2_reference_statistics": source,
            "dinov2_seconds": round(time.time() - start, 1)}
    return EvaluationResult(values, info)


def dinov2_reference(side: Side, extractor, batch_size: int,
                     workers: int = 0) -> tuple[tuple[np.ndarray, np.ndarray] | np.ndarray, str]:
    """The reference's stored DINOv2 (mu, sigma), else its images' features; and which it is ("stored", "features")."""
    keys = stored_stat_keys(["fd_dinov2"])
    if set(keys) <= set(side.stats):
        return tuple(side.stats[k] for k in keys), "stored"
    return dinov2_features(side, extractor, batch_size, "reference", workers), "features"


def dinov2_features(side: Side, extractor, batch_size: int, name: str, workers: int = 0) -> np.ndarray:
    """DINOv2 CLS features of every image of the side (the `name` one)."""
    features = side_features(side, extractor, batch_size, f"dinov2: {name}", workers)
    if features is None:
        raise UserError(f"fd_dinov2 needs images of the {name} (arr_0) or its stored mu_dinov2 / sigma_dinov2 "
                        "(evaluate.py --save-ref-stats ... --dinov2-weights FILE)")
    return features


def compute_metrics(samples: ADMBatch | str | os.PathLike, ref: str | os.PathLike | ADMBatch | None,
                    weights: str | os.PathLike, metrics=DEFAULT_METRICS, batch_size: int | None = None,
                    device: str | torch.device | None = None, **options) -> dict[str, float]:
    """FID / sFID / IS / precision / recall / KID of `samples` against `ref` (see `evaluate` for options).
    Keys: the requested metric names ('fid', 'sfid', 'is', 'precision', 'recall', 'kid' + 'kid_std')."""
    return evaluate(samples, ref, weights, metrics, batch_size, device, **options).metrics


def check_replaceable(out: Path) -> None:
    """An existing `out` is replaced only when it is a statistics file (mu, sigma, no images): a
    sample file or an ADM reference batch holds images that a rerun here would destroy."""
    if not out.exists():
        return
    try:
        with zipfile.ZipFile(out) as npz:
            members = set(npz.namelist())
    except (zipfile.BadZipFile, OSError):
        raise UserError(f"{out} exists and is not an .npz of reference statistics; move it or pick another "
                        "--save-ref-stats name") from None
    if "arr_0.npy" in members or "mu.npy" not in members:
        raise UserError(f"{out} exists and holds {'images (arr_0)' if 'arr_0.npy' in members else 'no statistics'}: "
                        "a sample file or an ADM reference batch, which writing statistics there would destroy; "
                        "pick another --save-ref-stats name")


def save_reference_stats(images_dir: str | os.PathLike, out: str | os.PathLike, weights: str | os.PathLike,
                         image_size: int = 256, with_images: bool = False, max_images: int | None = None,
                         seed: int = 0, batch_size: int | None = None, device: str | torch.device | None = None,
                         workers: int = 0, dinov2_weights: str | os.PathLike | None = None,
                         dinov2_model: str | None = None) -> Path:
    """Writes an ADM-compatible reference of `images_dir`'s images, center-cropped to `image_size` as
    in training, to `out`: `mu`, `sigma` (pool_3) and `mu_s`, `sigma_s` (mixed_6/conv[..., :7]) as in
    ADM's VIRTUAL_*.npz; optionally the crops as `arr_0` (+ `arr_1` labels when the folder has one
    subfolder per class), so that precision / recall can be computed against it; with `dinov2_weights`,
    FD-DINOv2's statistics. `max_images` keeps a seeded random subset (a sorted prefix of ImageNet would
    be a few classes)."""
    check_replaceable(Path(out))
    device = torch.device(device) if device is not None else default_device()
    extractor = loaded(InceptionExtractor, weights, device)  # fail on bad weights before reading any image
    dinov2 = None
    if dinov2_weights:
        from .dinov2 import DINOV2_MODEL, DinoV2Extractor
        dinov2 = loaded(DinoV2Extractor, dinov2_weights, dinov2_model or DINOV2_MODEL, device)
    listing = list_image_folder(images_dir)
    files, labels = listing.paths(), listing.labels
    if max_images is not None and max_images < len(files):
        keep = np.sort(np.random.default_rng(seed).choice(len(files), max_images, replace=False))
        files = [files[i] for i in keep]
        labels = None if labels is None else [labels[i] for i in keep]
    if len(files) < 2:
        raise UserError(f"{images_dir} has {len(files)} image(s); statistics need at least 2")
    batches = ImageFolderBatches(files, image_size, batch_size or default_batch_size(device), workers)
    kept: list[np.ndarray] = []
    dinov2_parts: list[np.ndarray] = []

    def keep_images():  # one pass over the files: the cropped images are kept as they stream by
        for batch in batches:
            if with_images:
                kept.append(batch)
            if dinov2 is not None:
                dinov2_parts.append(dinov2.batch(batch).numpy().astype(np.float64))
            yield batch

    features = extractor.extract(keep_images(), total=len(files), desc="inception: reference images")
    stats = {}
    stats["mu"], stats["sigma"] = feature_statistics(features.pool)
    stats["mu_s"], stats["sigma_s"] = feature_statistics(features.spatial)
    if dinov2 is not None:
        stats["mu_dinov2"], stats["sigma_dinov2"] = feature_statistics(np.concatenate(dinov2_parts))
    images = np.concatenate(kept) if with_images else None
    return save_adm_npz(out, images, labels if with_images else None, **stats)


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
