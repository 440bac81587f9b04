#!/usr/bin/env python3
"""Compares training runs of any topology or objective: curves and a Markdown table.

    python scripts/compare_runs.py RUN_A RUN_B ... --out REPORT_DIR [--group 'd12-ancre-*' ...] [--target fid/cfg1.5=20]

Writes REPORT_DIR/report.md (final values; every group against the first one, paired by seed:
steps to the target, the speedup with its 95% interval and a verdict, as a study report computes
them, see ancre_dit.studies.comparison), summary.json and curves_step.png / curves_images.png /
curves_seconds.png (training loss, held-out loss and every evaluated metric on shared axes, the mean
of a group with its t interval as a band). Runs that differ only in train.seed form a group;
--group patterns (matched against the run directory name) choose the groups instead.
"""
from __future__ import annotations

from pathlib import Path

from ancre_dit.cli import CommandParser, output_folder, run_cli
from ancre_dit.errors import UserError


def _targets(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        try:
            out[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise UserError(f"--target {item!r} must be METRIC=VALUE, e.g. --target heldout_loss=0.15")
    return out


def main() -> int:
    p = CommandParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (train.py's run_dir)")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--group", action="append", default=[], metavar="PATTERN",
                   help="runs whose directory name matches PATTERN (fnmatch) form one group; repeatable")
    p.add_argument("--target", action="append", default=[], metavar="METRIC=VALUE",
                   help="target of a metric for every seed (default: the first group's final value, seed by seed); "
                        "repeatable")
    args = p.parse_args()
    output_folder(args.out, "comparison report", "report.md")
    from ancre_dit.studies.comparison import write_report

    write_report(args.runs, args.out, args.group, _targets(args.target))
    print(f"report written to {Path(args.out) / 'report.md'} (+ summary.json, curves_*.png)")
    return 0


if __name__ == "__main__":
    run_cli(main)
