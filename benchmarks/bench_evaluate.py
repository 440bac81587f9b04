"""Evaluation cost: Inception feature throughput and the cost of each metric on 2048-d features.

    python -m benchmarks.bench_evaluate [--images 64] [--image-size 256] [--batch-size 32] [--features 4096] [--device cpu]

Uses a RANDOMLY INITIALISED weights file (timing only: the network's cost does not depend on its
weights); the metric timings use random Gaussian features of the real dimensions (2048 pool,
2023 spatial). Also reports how far the fast "eigh" Fréchet distance is from ADM's "sqrtm" one.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ancre_dit.evaluation import (
    InceptionExtractor, feature_statistics, frechet_distance, inception_score, precision_recall,
    write_random_inception_weights,
)
from ancre_dit.evaluation.inception import iterate_batches


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--features", type=int, default=4096, help="feature vectors per side for the metric timings")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_random_inception_weights(Path(tmp) / "random-inception.pth")
        extractor = InceptionExtractor(weights, device=args.device)
        images = rng.integers(0, 256, (args.images, args.image_size, args.image_size, 3), dtype=np.uint8)
        extractor.extract(iterate_batches(images[: args.batch_size], args.batch_size), desc="warm-up")
        _, seconds = _timed(lambda: extractor.extract(iterate_batches(images, args.batch_size), total=len(images)))
    rows = [(f"inception features, {args.images} imgs {args.image_size}px, batch {args.batch_size}, {args.device}",
             f"{seconds:.2f} s = {args.images / seconds:.1f} img/s -> 50K imgs in {50000 / (args.images / seconds) / 60:.0f} min")]

    n, d = args.features, 2048
    a = rng.normal(size=(n, d)).astype(np.float32)
    b = (rng.normal(size=(n, d)) * 1.1 + 0.05).astype(np.float32)
    (sa, sb), t_stats = _timed(lambda: (feature_statistics(a), feature_statistics(b)))
    rows.append((f"mu/sigma of 2 x {n} x {d}", f"{t_stats:.2f} s"))
    fid_sqrtm, t_sqrtm = _timed(lambda: frechet_distance(*sa, *sb, method="sqrtm"))
    fid_eigh, t_eigh = _timed(lambda: frechet_distance(*sa, *sb, method="eigh"))
    rows.append(("FID 2048-d, sqrtm (ADM)", f"{t_sqrtm:.2f} s  value {fid_sqrtm:.6f}"))
    rows.append(("FID 2048-d, eigh", f"{t_eigh:.2f} s  value {fid_eigh:.6f}  rel. diff {abs(fid_eigh - fid_sqrtm) / fid_sqrtm:.1e}"))
    (prec, rec), t_pr = _timed(lambda: precision_recall(a, b, device=args.device))
    rows.append((f"precision/recall k=3, {n} vs {n}, {args.device}", f"{t_pr:.2f} s  ({prec:.4f}, {rec:.4f})"))
    logits = rng.normal(size=(n, 1008)).astype(np.float32)
    _, t_is = _timed(lambda: inception_score(logits))
    rows.append((f"inception score, {n} logits", f"{t_is:.3f} s"))

    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


if __name__ == "__main__":
    main()
