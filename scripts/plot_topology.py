#!/usr/bin/env python3
"""topology.json (written at each checkpoint) -> heatmap PNG, plus the topology analysis.

    python scripts/plot_topology.py RUN/checkpoints/<step>/topology.json --out heatmap.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ancre_dit.figures import plot_topology_heatmap
from ancre_dit.models.topologies.analysis import format_topology_summary, topology_summary
from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import load_topology_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topology", type=Path, help="topology.json of a run (a 'probabilities' (K, K) matrix)")
    parser.add_argument("--out", type=Path, default=None, help="heatmap PNG (default: next to the JSON)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--summary-json", type=Path, default=None,
                        help="also write the topology analysis (strongest sources, anchors, entropy) here")
    args = parser.parse_args()
    try:
        P = load_topology_json(args.topology)
    except (ValueError, TypeError) as err:  # a ragged or non-numeric matrix (UserErrors pass through)
        if isinstance(err, UserError):
            raise
        raise UserError(f"{args.topology} is not a topology JSON with a square 'probabilities' matrix ({err})") from None
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise UserError(f"{args.topology} holds a {tuple(P.shape)} 'probabilities' array; a topology is a square "
                        "(K, K) matrix, as written at each checkpoint")
    out = args.out or args.topology.with_suffix(".png")
    plot_topology_heatmap(P, out, title=args.title)
    summary = topology_summary(P)
    print(format_topology_summary(summary))
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_text(json.dumps(summary, indent=1))
        print(f"summary written to {args.summary_json}")
    print(f"heatmap written to {out}")


if __name__ == "__main__":
    run_cli(main)
