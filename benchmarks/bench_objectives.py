#!/usr/bin/env python3
"""Flow matching against DDPM on the digits, each with ANCRe and cascaded residuals, through the product.

Every (seed, objective, topology) is one `train` run of the digits config (sized by the flags; DDPM:
learned sigma, hybrid loss; flow: velocity MSE, uniform time, learn_sigma off) with the in-training
evaluation on; `comparison.write_report` then writes one report per objective (topologies against each
other, seeds aggregated: curves, final values, steps to cascaded's final value). The final EMA
weights of each run sample the same balanced labels with the same seed at every sampler of their
objective, at one guidance scale: DDPM-250 and DPM-Solver-25, flow Euler-50, Heun-25, dopri5
(adaptive) and SiT's SDE-250. Per sampler, mean +- std over seeds: held-out classifier accuracy and
pixel Fréchet distance (ancre_dit.evaluation.digits_metric, NOT FID), network forward passes per sample
(guided: cond + uncond count 2) and sampling wall time. Reruns continue unfinished runs.

    python -m benchmarks.bench_objectives --seeds 0 1 2 --steps 1000 --depth 4 --width 64 --num-samples 100
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ancre_dit.cli import run_cli

SAMPLERS = {"ddpm": [("ddpm", 250), ("dpm-solver", 25)],
            "flow": [("euler", 50), ("heun", 25), ("dopri5", None), ("sde", 250)]}
EVAL_SAMPLER = {"ddpm": "eval.sampler=dpm-solver", "flow": "eval.sampler=heun"}  # the in-training evaluation's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=Path("configs/digits-ancre.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--topologies", nargs="+", default=["cascaded", "ancre"], help="the first is the reports' baseline")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=250, help="in-training evaluation (held-out loss, digits metric)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--num-samples", type=int, default=100)
    p.add_argument("--cfg-scale", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/bench-objectives"))
    return p.parse_args(argv)


def train_run(args: argparse.Namespace, objective: str, topology: str, seed: int) -> Path:
    """One digits run through `train` (resumed when a previous call stopped); returns its final checkpoint."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from ancre_dit.training.config import load_config
    from ancre_dit.training.trainer import train

    run_dir = args.out / "runs" / f"{objective}-{topology}-s{seed}"
    overrides = [f"run_dir={run_dir}", f"model.topology={topology}", f"model.depth={args.depth}",
                 f"model.hidden_size={args.width}", f"model.num_heads={args.heads}",
                 f"model.learn_sigma={str(objective == 'ddpm').lower()}", f"diffusion.objective={objective}",
                 f"train.seed={seed}", f"train.max_steps={args.steps}", f"train.ckpt_every={args.steps}",
                 f"train.global_batch_size={args.batch_size}", f"train.lr={args.lr}",
                 f"train.ema_decay={args.ema_decay}", f"train.eval_every={args.eval_every}", "train.sample_every=0",
                 "train.keep_last=1", "log.tensorboard=false", EVAL_SAMPLER[objective],
                 f"eval.num_samples={args.num_samples}", f"eval.batch_size={args.num_samples}",
                 f"eval.cfg_scales=[{args.cfg_scale}]"]
    AcceleratorState._reset_state(True)  # Accelerate's state is process-wide: each run starts its own
    GradientState._reset_state()
    PartialState._reset_state()
    result = train(load_config(args.config, overrides), resume="auto")
    return run_dir / "checkpoints" / f"{result['step']:07d}"


def score(checkpoint: Path, sampler: str, steps: int | None, labels: np.ndarray, cfg: float,
          seed: int) -> dict[str, float]:
    """Digits accuracy / pixel FD of the checkpoint's EMA samples, forwards per sample, seconds."""
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.evaluation.digits_metric import digits_report
    from ancre_dit.sampling import Guidance, plan_sampling
    from ancre_dit.sampling.api import decode_pixels

    model, spec = load_trained_model(checkpoint, "ema")
    plan = plan_sampling(model.eval(), spec["diffusion"], sampler=sampler, steps=steps, guidance=Guidance(cfg))
    start = time.perf_counter()
    with torch.inference_mode():
        latents = plan.latents(torch.from_numpy(labels), np.arange(len(labels)), seed)
    seconds = time.perf_counter() - start
    report = digits_report(decode_pixels(latents), labels)
    return {"accuracy": report["accuracy"], "pixel_fd": report["pixel_fd"], "seconds": seconds,
            "forwards_per_sample": plan.denoiser.calls / len(labels)}


def main(argv: list[str] | None = None) -> None:
    from ancre_dit.studies.comparison import write_report

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    labels = np.arange(args.num_samples) % 10
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"objectives benchmark {stamp}: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); {args.config}, depth {args.depth}, width {args.width}, batch "
          f"{args.batch_size}, lr {args.lr:g}, EMA {args.ema_decay:g}, {args.steps} steps, seeds {args.seeds}; "
          f"{args.num_samples} EMA samples per sampler at cfg {args.cfg_scale:g}", flush=True)
    rows: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for objective in SAMPLERS:
        for seed in args.seeds:
            for topology in args.topologies:
                checkpoint = train_run(args, objective, topology, seed)
                for sampler, steps in SAMPLERS[objective]:
                    r = score(checkpoint, sampler, steps, labels, args.cfg_scale, seed)
                    rows.setdefault((objective, topology, f"{sampler}-{steps or 'adaptive'}"), []).append(r)
        runs = [args.out / "runs" / f"{objective}-{t}-s{s}" for t in args.topologies for s in args.seeds]
        write_report(runs, args.out / f"report-{objective}", [f"{objective}-{t}-s*" for t in args.topologies])
        print(f"{objective}: report written to {args.out / f'report-{objective}' / 'report.md'}", flush=True)
    print("\n| objective | topology | sampler | accuracy | pixel FD | forwards / sample | sampling s |")
    print("|---|---|---|---|---|---|---|")
    for (objective, topology, sampler), rs in rows.items():
        acc, fd = np.array([r["accuracy"] for r in rs]), np.array([r["pixel_fd"] for r in rs])
        nfe, sec = np.mean([r["forwards_per_sample"] for r in rs]), np.mean([r["seconds"] for r in rs])
        print(f"| {objective} | {topology} | {sampler} | {acc.mean():.3f} +- {acc.std():.3f} | {fd.mean():.2f} +- "
              f"{fd.std():.2f} | {nfe:.0f} | {sec:.1f} |")
    raw = args.out / "samplers.json"
    raw.write_text(json.dumps({"date": stamp, "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": {" ".join(k): v for k, v in rows.items()}}, indent=1))
    print(f"raw sampler results: {raw}")


if __name__ == "__main__":
    run_cli(main)
