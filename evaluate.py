"""Scores samples with FID, sFID, IS, precision and recall as ADM's (TensorFlow) evaluator does.

    python evaluate.py --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz \\
        --inception-weights weights/weights-inception-2015-12-05-6726825d.pth [--metrics fid,sfid,is,precision,recall,kid] \\
        [--json results.json] [--batch-size 250]
    python evaluate.py --save-ref-stats ref.npz --images IMAGES_DIR --inception-weights FILE [--image-size 256] [--with-images]
    python evaluate.py --samples samples.npz --ref REF.npz --metrics fd_dinov2 --dinov2-weights FILE \\
        [--dinov2-model vit_large_patch14_dinov2]   # FD-DINOv2 (EDM2 / dgm-eval protocol; no Inception needed)
    python evaluate.py --samples samples.npz --digits      # offline check for the 8x8 digits default (not FID-50K)
    python evaluate.py --run RUN_DIR [--steps 500,1000] [eval.num_samples=5000 ...]
        # every checkpoint of a training run, with its config's eval section, into RUN_DIR/logs/evals.jsonl
        # (resumable: checkpoints already evaluated with the same settings are skipped); on several
        # processes: accelerate launch evaluate.py --run ... (torchrun reads --run as its --run-path)

REF is an ADM reference npz (arr_0 images and/or mu, sigma, mu_s, sigma_s), a folder of images
(center-cropped to the samples' size, as in training) or another sample npz.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ancre_dit.cli import CommandParser, output_file, run_cli
from ancre_dit.errors import UserError
from ancre_dit.evaluation.metric_registry import METRICS, metric_names
from ancre_dit.evaluation.metrics import FID_METHODS


def _metrics_help() -> str:
    offered = "; ".join(f"{name}: {METRICS[name].help}" for name in metric_names(evaluate=True))
    return f"comma-separated metrics (default: ADM's {','.join(metric_names(default=True))}) of: {offered}"


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", help="sample .npz (ADM layout) or a folder of images")
    p.add_argument("--ref", help="reference: ADM .npz (images and/or statistics), folder of images, or sample .npz")
    p.add_argument("--inception-weights", default=os.environ.get("ANCRE_INCEPTION_WEIGHTS"),
                   help="local weights-inception-2015-12-05-6726825d.pth (default: $ANCRE_INCEPTION_WEIGHTS); "
                        "never downloaded")
    p.add_argument("--metrics", default=",".join(metric_names(default=True)), help=_metrics_help())
    p.add_argument("--dinov2-weights", default=os.environ.get("ANCRE_DINOV2_WEIGHTS"),
                   help="local timm weights file of --dinov2-model for fd_dinov2 (and --save-ref-stats); "
                        "default $ANCRE_DINOV2_WEIGHTS; never downloaded")
    p.add_argument("--dinov2-model", default="vit_large_patch14_dinov2",
                   help="timm name of the DINOv2 network (default vit_large_patch14_dinov2, ViT-L/14)")
    p.add_argument("--json", help="also write the results (+ sample count, reference, weights file) here")
    p.add_argument("--batch-size", type=int, help="images per Inception batch (default 250 on GPU, 32 on CPU)")
    p.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: cuda when available)")
    p.add_argument("--workers", type=int, default=0, help="image-decoding processes for folders of images")
    p.add_argument("--image-size", type=int,
                   help="center-crop size for folders of images (default: the samples' size; 256 for --save-ref-stats)")
    g = p.add_argument_group("metric settings (defaults are ADM's)")
    g.add_argument("--is-split-size", type=int, default=5000, help="images per Inception Score split")
    g.add_argument("--pr-k", type=int, default=3, help="nearest neighbour that sets precision/recall radii")
    g.add_argument("--fid-method", choices=FID_METHODS, default="sqrtm",
                   help="sqrtm: ADM's scipy sqrtm handling; eigh: same value, faster, stable for few samples")
    g.add_argument("--kid-subsets", type=int, default=100)
    g.add_argument("--kid-subset-size", type=int, default=1000)
    r = p.add_argument_group("building a reference")
    r.add_argument("--save-ref-stats", metavar="OUT.npz", help="write an ADM reference from --images DIR and exit")
    r.add_argument("--images", metavar="DIR", help="folder of real images (class subfolders give labels)")
    r.add_argument("--with-images", action="store_true", help="also store the cropped images (arr_0) in OUT.npz")
    r.add_argument("--max-images", type=int, help="use a seeded random subset of this many images")
    r.add_argument("--seed", type=int, default=0, help="seed of that subset")
    t = p.add_argument_group("evaluating a training run")
    t.add_argument("--run", metavar="RUN_DIR", help="evaluate every checkpoint of this run (as training's eval does)")
    t.add_argument("--steps", help="only these checkpoint steps, comma-separated (default: all)")
    t.add_argument("--cpu", action="store_true", help="with --run: stay on the CPU even if a GPU is present")
    t.add_argument("overrides", nargs="*", metavar="eval.KEY=VALUE", help="with --run: eval settings to change")
    p.add_argument("--digits", action="store_true",
                   help="offline digits check of --samples (class accuracy + pixel Fréchet distance; NOT FID-50K)")
    return p


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _digits(args) -> int:
    from ancre_dit.data.adm_npz import load_adm_npz
    from ancre_dit.evaluation.digits_metric import digits_report, format_digits_report

    batch = load_adm_npz(args.samples)
    if batch.images is None or batch.labels is None:
        raise UserError(f"{args.samples} needs images (arr_0) and labels (arr_1) for --digits; write it with sample.py")
    size = batch.images.shape[1:3]
    if tuple(size) != (8, 8):
        raise UserError(f"--digits scores the 8x8 samples of a digits run; {args.samples} holds {size[0]}x{size[1]} "
                        "images: evaluate them with --ref and the Inception metrics instead")
    if len(batch.labels) and not (0 <= batch.labels.min() and batch.labels.max() <= 9):
        raise UserError(f"{args.samples}: --digits needs labels 0..9, arr_1 holds "
                        f"{batch.labels.min()}..{batch.labels.max()}; pass the samples of a digits run")
    report = digits_report(batch.images, batch.labels)
    print(format_digits_report(report))
    if args.json:
        _write_json(args.json, {"metrics": report, "samples": str(Path(args.samples).resolve()),
                                "note": "digits offline check, NOT FID-50K", "sampling": _sampling(args.samples)})
    return 0


def _run(args) -> int:
    from ancre_dit.training.config import check_unique_overrides
    from ancre_dit.training.run_evaluation import evaluate_run

    steps = None
    if args.steps:
        try:
            steps = [int(s) for s in args.steps.split(",") if s.strip()]
        except ValueError:
            raise UserError(f"--steps {args.steps!r} must be comma-separated integers, e.g. --steps 500,1000") from None
    evaluate_run(args.run, steps, check_unique_overrides(args.overrides), cpu=args.cpu)
    return 0


def _save_ref(args) -> int:
    from ancre_dit.evaluation.pipeline import save_reference_stats

    if not args.images:
        raise UserError("--save-ref-stats needs --images DIR (a folder of real images)")
    out = save_reference_stats(args.images, args.save_ref_stats, args.inception_weights,
                               image_size=args.image_size or 256, with_images=args.with_images,
                               max_images=args.max_images, seed=args.seed, batch_size=args.batch_size,
                               device=args.device, workers=args.workers, dinov2_weights=args.dinov2_weights,
                               dinov2_model=args.dinov2_model)
    print(f"reference statistics written to {out}")
    return 0


def _sampling(samples: str) -> dict | None:
    """The settings sample.py drew `samples` with (its .sampling.json), so numbers are compared only
    between equal protocols; None for samples from elsewhere."""
    from ancre_dit.sampling.protocols import read_sampling_record

    record = read_sampling_record(samples)
    print(f"sampling settings: {'unknown (no ' + Path(samples).stem + '.sampling.json)' if record is None else record}")
    return record


def _write_json(path: str, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {path}")


def main() -> int:
    args = build_parser().parse_args()
    if args.json:
        output_file(args.json, (".json",), "--json")
    if args.save_ref_stats:
        output_file(args.save_ref_stats, (".npz",), "--save-ref-stats")
    _check_positive(batch_size=args.batch_size, is_split_size=args.is_split_size, pr_k=args.pr_k,
                    kid_subsets=args.kid_subsets, kid_subset_size=args.kid_subset_size, image_size=args.image_size,
                    max_images=args.max_images)
    if args.save_ref_stats:
        return _save_ref(args)
    if args.run:
        return _run(args)
    if args.overrides or args.steps:
        raise UserError("--steps and eval.* overrides go with --run RUN_DIR")
    if args.digits:
        if not args.samples:
            raise UserError("--digits needs --samples samples.npz")
        return _digits(args)
    if not args.samples:
        raise UserError("pass --samples and --ref (or --save-ref-stats OUT.npz --images DIR, or --digits)")
    from ancre_dit.evaluation.inception import check_weights
    from ancre_dit.evaluation.pipeline import evaluate, format_table, parse_metrics

    metrics = parse_metrics(args.metrics)
    if any(METRICS[m].features == "inception" for m in metrics):  # FD-DINOv2 alone needs no Inception
        try:
            check_weights(args.inception_weights)
        except UserError as err:
            raise UserError(f"{err}; for the 8x8 digits default, --digits gives an offline check instead") from None
    dinov2 = [m for m in metrics if METRICS[m].features == "dinov2"]
    if dinov2 and not args.dinov2_weights:
        raise UserError(f"{', '.join(dinov2)} needs --dinov2-weights FILE (a local timm weights file of "
                        "--dinov2-model; nothing is downloaded)")
    result = evaluate(args.samples, args.ref, args.inception_weights, metrics=args.metrics,
                      batch_size=args.batch_size, device=args.device, is_split_size=args.is_split_size,
                      pr_k=args.pr_k, fid_method=args.fid_method, kid_subsets=args.kid_subsets,
                      kid_subset_size=args.kid_subset_size, image_size=args.image_size, workers=args.workers,
                      dinov2_weights=args.dinov2_weights, dinov2_model=args.dinov2_model)
    print(format_table(result))
    if args.json:
        _write_json(args.json, {"metrics": result.metrics, **result.info, "sampling": _sampling(args.samples)})
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    run_cli(main)
