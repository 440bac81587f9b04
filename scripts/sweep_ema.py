#!/usr/bin/env python3
"""Sweeps the EMA length of trained runs without retraining (post-hoc EMA), and says whether it helps.

    python scripts/sweep_ema.py RUN --stds 0.02,0.05,0.1,0.15
    python scripts/sweep_ema.py results/studies/posthoc-ema/runs/phema-s* --stds 0.02,0.04,0.06,0.08,0.1,0.15,0.2

Each run must have trained with train.phema. At its newest checkpoint every std is rebuilt from the
snapshots and scored with the run's own evaluation settings (digits metric, FID, held-out loss) next
to the run's fixed EMA, on two evaluation seeds (RUN/ema_sweep.json). With several runs (the seeds of
a study), the paired difference of the best std (picked on one seed, scored on the other) against
the fixed EMA is printed with its 95% interval and the verdict.
"""
from __future__ import annotations

import json
from pathlib import Path

from ancre_dit.cli import CommandParser, run_cli
from ancre_dit.training.ema_sweep import SWEEP_FILE, compare_sweeps, sweep_ema


def _stds(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="training run folders (trained with train.phema)")
    p.add_argument("--stds", type=_stds, required=True, help="comma-separated relative stds, e.g. 0.05,0.1,0.15")
    p.add_argument("--metric", default=None, help="the metric to compare (default: the first sample metric, "
                                                  "else the held-out loss)")
    p.add_argument("--reuse", action="store_true", help="read RUN/ema_sweep.json where a run has one")
    p.add_argument("--cpu", action="store_true", help="evaluate on the CPU even if a GPU is present")
    a = p.parse_args(argv)
    sweeps = {}
    for run in a.runs:
        path = run / SWEEP_FILE
        sweeps[run.name] = json.loads(path.read_text()) if a.reuse and path.is_file() else sweep_ema(
            run, a.stds, cpu=a.cpu)
    first = next(iter(sweeps.values()))["metrics"]["ema"][0]
    metric = a.metric or next((k for k in first if not k.startswith("heldout")), "heldout_loss")
    print(compare_sweeps(sweeps, metric))
    return 0


if __name__ == "__main__":
    run_cli(main)
