#!/usr/bin/env python3
"""Times the quickstart's three steps (train, sample, evaluate) and reports the digits accuracy.

Runs what scripts/quickstart.sh runs (without the installs), each step as its own process with
OMP_NUM_THREADS=--threads, from a fresh run folder: train.py with the quickstart config plus any
overrides given after `--`, sample.py from the last checkpoint's EMA weights, evaluate.py --digits.
Reports wall and CPU seconds per step (CPU = user + system of the step's process: on a shared
box it shows what the step would take alone with one thread) and the held-out classifier's
accuracy on the samples. Writes RUN/bench_quickstart.json.

    python -m benchmarks.bench_quickstart                                   # the quickstart as it is
    python -m benchmarks.bench_quickstart --config configs/digits-ancre.yaml --sampler ddpm --steps 50 --sample-batch 100  # the old one
    python -m benchmarks.bench_quickstart --threads 2 -- train.max_steps=400 train.global_batch_size=128
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = re.compile(r"class accuracy\s+([0-9.]+)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--run-dir", default=str(ROOT / "results" / "bench_quickstart"), help="replaced if it exists")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every step")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--sample-batch", type=int, default=200)
    p.add_argument("--sampler", default="heun", help="sample.py --sampler (quickstart.sh: heun)")
    p.add_argument("--steps", type=int, default=10, help="sampling steps (quickstart.sh: 10)")
    p.add_argument("--cfg-scale", type=float, default=2.0)
    p.add_argument("overrides", nargs="*", help="config overrides for train.py (after --), e.g. train.max_steps=800")
    args = p.parse_args(argv)
    if args.threads < 1 or args.num_samples < 1:
        raise UserError("--threads and --num-samples must be at least 1")
    return args


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of one command; its output is echoed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.stdout.write(proc.stdout[-2000:])
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise UserError(f"{' '.join(cmd[:3])} ... failed with exit code {proc.returncode} (its output is above)")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout + proc.stderr


def measure(args) -> dict:
    run = Path(args.run_dir)
    if run.exists():
        shutil.rmtree(run)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    py = sys.executable
    steps = {}
    steps["train"] = timed([py, "train.py", "--config", args.config, f"run_dir={run}", *args.overrides], env)
    ckpt = sorted((run / "checkpoints").glob("[0-9]*"))[-1]
    samples = run / "samples.npz"
    steps["sample"] = timed([py, "sample.py", "--ckpt", str(ckpt), "--num-samples", str(args.num_samples),
                             "--batch-size", str(args.sample_batch), "--cfg-scale", str(args.cfg_scale),
                             "--sampler", args.sampler, "--steps", str(args.steps), "--out", str(samples), "--cpu"], env)
    steps["evaluate"] = timed([py, "evaluate.py", "--samples", str(samples), "--digits"], env)
    found = ACCURACY.search(steps["evaluate"][2])
    if not found:
        raise UserError("evaluate.py printed no class accuracy; run it by hand to see why")
    rates = re.findall(r"([0-9.]+) steps/s", steps["train"][2])
    report = {"overrides": args.overrides, "threads": args.threads, "sampler": args.sampler, "sampling_steps": args.steps,
              "cfg_scale": args.cfg_scale, "num_samples": args.num_samples, "accuracy": float(found.group(1)),
              "last_logged_steps_per_s": float(rates[-1]) if rates else None,
              "load_average_at_end": os.getloadavg()[0],
              "seconds": {k: {"wall": v[0], "cpu": v[1]} for k, v in steps.items()}}
    report["seconds"]["total"] = {k: sum(v[k] for v in report["seconds"].values()) for k in ("wall", "cpu")}
    (run / "bench_quickstart.json").write_text(json.dumps(report, indent=1))
    print(f"\n{'step':<10}{'wall s':>10}{'cpu s':>10}")
    for k, v in report["seconds"].items():
        print(f"{k:<10}{v['wall']:>10.1f}{v['cpu']:>10.1f}")
    print(f"class accuracy {report['accuracy']:.3f} (goal >= 0.95); threads {args.threads}; "
          f"load average {report['load_average_at_end']:.2f}; overrides: {' '.join(args.overrides) or '(none)'}")
    return report


def main(argv=None) -> None:
    measure(parse_args(argv))


if __name__ == "__main__":
    run_cli(main)
