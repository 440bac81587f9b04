"""Sampling benchmark (a script, not a test).

1. Speed: images/s of DDPM-250 and DPM-Solver-25 with classifier-free guidance (one batched
   cond+uncond forward per step) at DiT-S/2 and DiT-B/2 shapes (32x32x4 latents, 1000 classes,
   random weights; VAE decoding not included). On a CPU use few images and, if needed,
   fewer steps (--ddpm-steps): the printed lines say which steps were run.
2. Quality on the digits model: 25 DPM-Solver++ steps against 250 DDPM steps, scored with the
   offline digits metric (class accuracy of an independent classifier + pixel Frechet distance).
   Needs a trained digits checkpoint (default: the newest of results/quickstart/checkpoints/).

    python -m benchmarks.bench_sampling --num-images 2 --ddpm-steps 25 --digits-samples 200   # CPU
    python -m benchmarks.bench_sampling --num-images 64 --precision bf16                      # GPU
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import create_model
from ancre_dit.diffusion import DDPMObjective
from ancre_dit.sampling import Guidance, sample_images, sample_latents

DIFFUSION = DDPMObjective(learn_sigma=True)  # DiT's schedule


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampler(model: torch.nn.Module, device: torch.device, n: int, sampler: str, steps: int, cfg: float,
                 precision: str) -> float:
    """Seconds to sample n latents (one batch) after a one-step warm-up."""
    labels = np.arange(n) % model.num_classes
    sample_latents(model, DIFFUSION, labels[:1], sampler="ddim", steps=1, guidance=Guidance(cfg), precision=precision)
    _sync(device)
    start = time.perf_counter()
    sample_latents(model, DIFFUSION, labels, sampler=sampler, steps=steps, guidance=Guidance(cfg), precision=precision)
    _sync(device)
    return time.perf_counter() - start


def speed(args: argparse.Namespace, device: torch.device) -> None:
    print(f"## speed: {args.num_images} images per run, cfg {args.cfg_scale} (batched cond+uncond), "
          f"32x32x4 latents, random weights, topology {args.topology}, {args.precision}, no VAE decode")
    for name in args.models:
        torch.manual_seed(0)
        model = create_model(name, topology=args.topology, input_size=32, in_channels=4, num_classes=1000,
                             learn_sigma=True).to(device).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        for sampler, steps, nominal in (("ddpm", args.ddpm_steps, 250), ("dpm-solver", args.dpm_steps, 25)):
            seconds = time_sampler(model, device, args.num_images, sampler, steps, args.cfg_scale, args.precision)
            note = "" if steps == nominal else f" (run with {steps} steps instead of {nominal}; at {nominal} steps " \
                f"expect about {args.num_images / (seconds * nominal / steps):.4f} images/s)"
            print(f"{name} ({params:.1f}M params) {sampler}-{steps}: {args.num_images / seconds:.4f} images/s, "
                  f"{seconds / args.num_images:.2f} s/image, {seconds / steps * 1000:.1f} ms/step for the batch{note}")
        del model


def newest_checkpoint(root: Path) -> Path | None:
    steps = [p for p in root.glob("*") if p.is_dir() and p.name.isdigit() and (p / "model_spec.json").is_file()]
    return max(steps, key=lambda p: int(p.name)) if steps else None


def digits_quality(args: argparse.Namespace, device: torch.device) -> None:
    from ancre_dit.checkpoint import load_trained_model

    ckpt = Path(args.digits_ckpt) if args.digits_ckpt else newest_checkpoint(Path("results/quickstart/checkpoints"))
    print(f"## digits quality: DPM-Solver++-25 vs DDPM-250, cfg {args.digits_cfg}, {args.digits_samples} samples")
    if ckpt is None or not (ckpt / "model_spec.json").is_file():
        print(f"skipped: no trained digits checkpoint ({args.digits_ckpt or 'results/quickstart/checkpoints/<step>'}); "
              f"run bash scripts/quickstart.sh or pass --digits-ckpt RUN/checkpoints/<step>")
        return
    from ancre_dit.evaluation.digits_metric import digits_report

    model, spec = load_trained_model(ckpt, "ema", device)
    if spec["data"].get("kind") != "digits":
        raise UserError(f"{ckpt} is a {spec['data'].get('kind')} model, not a digits one; pass a digits checkpoint")
    labels = np.arange(args.digits_samples) % model.num_classes
    print(f"checkpoint {ckpt} (step {spec.get('step')})")
    for sampler, steps in (("ddpm", 250), ("dpm-solver", 25)):
        start = time.perf_counter()
        images = []
        for s in range(0, len(labels), args.batch_size):
            idx = np.arange(s, min(s + args.batch_size, len(labels)))
            images.append(sample_images(model, spec["diffusion"], labels[idx], indices=idx, seed=args.seed,
                                        sampler=sampler, steps=steps, guidance=Guidance(args.digits_cfg)))
        seconds = time.perf_counter() - start
        report = digits_report(np.concatenate(images), labels)
        print(f"{sampler}-{steps}: accuracy {report['accuracy']:.3f}, pixel FD {report['pixel_fd']:.2f} "
              f"(real held-out: accuracy {report['real_heldout_accuracy']:.3f}, pixel FD "
              f"{report['real_heldout_pixel_fd']:.2f}), {seconds:.1f} s")


def main() -> int:
    p = argparse.ArgumentParser(description="images/s of DDPM-250 / DPM-Solver-25 and their quality on digits")
    p.add_argument("--models", nargs="+", default=["DiT-S/2", "DiT-B/2"])
    p.add_argument("--topology", default="cascaded")
    p.add_argument("--num-images", type=int, default=4)
    p.add_argument("--ddpm-steps", type=int, default=250)
    p.add_argument("--dpm-steps", type=int, default=25)
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--digits-ckpt", default=None)
    p.add_argument("--digits-samples", type=int, default=200)
    p.add_argument("--digits-cfg", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-digits", action="store_true")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    print(f"# bench_sampling on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    with torch.inference_mode():
        if not args.skip_speed:
            speed(args, device)
        if not args.skip_digits:
            digits_quality(args, device)
    return 0


if __name__ == "__main__":
    run_cli(main)
