#!/usr/bin/env python3
"""Rebuilds, after training, the EMA of any length from a run's post-hoc EMA snapshots (EDM2's method).

    python scripts/reconstruct_ema.py RUN --std 0.08 --out RUN/posthoc/std0.08        # at the last snapshot
    python scripts/reconstruct_ema.py RUN --std 0.06 --at 200000 --out ckpts/std0.06-200k
    python sample.py --ckpt RUN/posthoc/std0.08 --num-samples 50000 --out samples.npz

The run must have trained with train.phema (stds and snapshot_every): its RUN/phema/<step>.safetensors
hold the tracked EMAs; the rebuilt one is the combination of them closest to the target profile. The
output is a checkpoint folder (its EMA weights), read by sample.py and the evaluation like any other.
"""
from __future__ import annotations

from pathlib import Path

from ancre_dit.checkpoint import SPEC_FILE
from ancre_dit.cli import CommandParser, output_folder, run_cli
from ancre_dit.training.phema import write_reconstruction


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="the training run's folder (holding phema/ and checkpoints/)")
    p.add_argument("--std", type=float, required=True, help="the EMA length as a relative std (EDM2: 0.05-0.15)")
    p.add_argument("--at", type=int, default=None, help="the step to rebuild at (default: the last snapshot)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write (new or empty)")
    a = p.parse_args(argv)
    output_folder(a.out, "checkpoint folder", SPEC_FILE)
    spec = write_reconstruction(a.run, a.std, a.at, a.out)
    info = spec["posthoc_ema"]
    print(f"rebuilt the EMA of std {a.std:g} at step {spec['step']} from {info['snapshots']} snapshots "
          f"(steps {info['first']}..{info['last']}) into {a.out}")
    print(f"sample it with: python sample.py --ckpt {a.out} --out samples.npz")
    return 0


if __name__ == "__main__":
    run_cli(main)
