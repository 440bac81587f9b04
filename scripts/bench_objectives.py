#!/usr/bin/env python3
"""Flow matching against DDPM on the digits default, each with ANCRe and cascaded residuals.

For every seed, the four runs (ddpm / flow x cascaded / ancre) share the model initialisation,
the batches and the label dropout (bench_convergence's plain loop); they differ in the objective
only (DDPM: learned sigma, hybrid loss; flow: velocity MSE, uniform time, learn_sigma off). The EMA
weights of each run then sample the same balanced labels with the same seed at matched network
evaluations: DDPM-250 and DPM-Solver-25 against flow Euler-50, Heun-25, dopri5 (adaptive) and
SiT's SDE-250, all with the same guidance scale. Reported per sampler, mean +- std over seeds:
held-out classifier accuracy and pixel Fréchet distance (ancre_dit.evaluation.digits, NOT FID),
network forward passes per sample (guided: cond + uncond count 2) and sampling wall time.

    python scripts/bench_objectives.py --seeds 0 1 2 --steps 1000 --depth 4 --width 64 --num-samples 100
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ancre_dit.cli import run_cli
from ancre_dit.data.digits import DigitsDataset
from ancre_dit.evaluation.digits import digits_report
from ancre_dit.sampling import Guidance, plan_sampling
from ancre_dit.sampling.decode import decode_pixels

SAMPLERS = {"ddpm": [("ddpm", 250), ("dpm-solver", 25)],
            "flow": [("euler", 50), ("heun", 25), ("dopri5", None), ("sde", 250)]}


def _convergence_module():
    """bench_convergence.py's training loop (scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_convergence", Path(__file__).with_name("bench_convergence.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def score(model: torch.nn.Module, objective, sampler: str, steps: int | None, labels: np.ndarray, cfg: float,
          seed: int) -> dict[str, float]:
    plan = plan_sampling(model, objective, sampler=sampler, steps=steps, guidance=Guidance(cfg))
    start = time.perf_counter()
    latents = plan.latents(torch.from_numpy(labels), np.arange(len(labels)), seed)
    seconds = time.perf_counter() - start
    report = digits_report(decode_pixels(latents), labels)
    return {"accuracy": report["accuracy"], "pixel_fd": report["pixel_fd"], "seconds": seconds,
            "forwards_per_sample": plan.denoiser.calls / len(labels)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--topologies", nargs="+", default=["cascaded", "ancre"])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--num-samples", type=int, default=100)
    p.add_argument("--cfg-scale", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/objectives.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    bench = _convergence_module()
    train = DigitsDataset("train")
    labels = np.arange(args.num_samples) % 10
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"objectives benchmark {stamp}: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); digits, depth {args.depth}, width {args.width}, batch "
          f"{args.batch_size}, AdamW lr {args.lr:g}, EMA {args.ema_decay:g}, {args.steps} steps, seeds {args.seeds}; "
          f"{args.num_samples} EMA samples per sampler at cfg {args.cfg_scale:g}", flush=True)
    rows: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    train_seconds: dict[tuple[str, str], list[float]] = {}
    for seed in args.seeds:
        for objective in ("ddpm", "flow"):
            for topology in args.topologies:
                cfg = bench.RunConfig(topology=topology, depth=args.depth, width=args.width, heads=args.heads,
                                      batch_size=args.batch_size, lr=args.lr, ema_decay=args.ema_decay,
                                      learn_sigma=objective == "ddpm", objective=objective, steps=args.steps,
                                      eval_every=args.steps, seed=seed)
                result, _, ema = bench.train_run(cfg, train)
                train_seconds.setdefault((objective, topology), []).append(result.seconds)
                obj = bench.build_run_objective(cfg)
                for sampler, steps in SAMPLERS[objective]:
                    r = score(ema.eval(), obj, sampler, steps, labels, args.cfg_scale, seed)
                    rows.setdefault((objective, topology, f"{sampler}-{steps or 'adaptive'}"), []).append(r)
                    print(f"seed {seed} {objective} {topology} {sampler}-{steps or 'adaptive'}: accuracy "
                          f"{r['accuracy']:.3f}, pixel FD {r['pixel_fd']:.2f}, {r['forwards_per_sample']:.0f} "
                          f"forwards/sample, {r['seconds']:.1f} s (training {result.seconds:.0f} s)", flush=True)
    print("\n| objective | topology | sampler | accuracy | pixel FD | forwards / sample | sampling s | training s |")
    print("|---|---|---|---|---|---|---|---|")
    for (objective, topology, sampler), rs in rows.items():
        acc, fd = np.array([r["accuracy"] for r in rs]), np.array([r["pixel_fd"] for r in rs])
        nfe, sec = np.mean([r["forwards_per_sample"] for r in rs]), np.mean([r["seconds"] for r in rs])
        tsec = np.mean(train_seconds[(objective, topology)])
        print(f"| {objective} | {topology} | {sampler} | {acc.mean():.3f} +- {acc.std():.3f} | {fd.mean():.2f} +- "
              f"{fd.std():.2f} | {nfe:.0f} | {sec:.1f} | {tsec:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": stamp, "args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": {" ".join(k): v for k, v in rows.items()}}, indent=1))
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    run_cli(main)
