#!/usr/bin/env python3
"""Learned topologies: draw one, compare runs, prune to a sparse frozen topology, watch one evolve.

    python scripts/topology.py show RUN_OR_JSON [--out heatmap.png] [--title T] [--summary-json F]
    python scripts/topology.py compare RUN_A RUN_B RUN_C [--out compare.png] [--json compare.json]
    python scripts/topology.py prune RUN_OR_JSON --top-k 2 --out sparse.json   (or --threshold 0.1)
    python scripts/topology.py evolution RUN [--out evolution.png] [--gif evolution.gif]

A RUN_OR_JSON is a run directory (its newest topology.json) or a topology.json file. `show` draws
the heatmap (default: next to the JSON) and prints the per-block summary (strongest sources,
anchors, entropy). `compare` reports the Pearson correlation of the learned edge weights (blocks
2..K; block 1's single edge is always 1) and how often the strongest incoming edge of a block comes
from the same source; a pruned file trains with `model.topology=frozen model.topology_path=sparse.json`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ancre_dit.cli import run_cli
from ancre_dit.errors import MissingFileError, UserError
from ancre_dit.models import load_topology_json
from ancre_dit.models.topologies.analysis import (checkpoint_topologies, compare_topologies, format_comparison,
                                                  format_topology_summary, load_topology, prune_topology,
                                                  topology_summary, write_topology)


def _names(paths: list[Path]) -> list[str]:
    """Short unique labels: the file or run name, with its parent folder where names repeat."""
    names = [p.stem if p.is_file() and p.name != "topology.json" else (p.parent.name if p.is_file() else p.name)
             for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def show(args) -> None:
    from ancre_dit.figures import plot_topology_heatmap

    path = args.topology
    if path.is_dir():
        if not (path / "topology.json").is_file():
            raise MissingFileError(f"{path} holds no topology.json; pass a run directory of a topology with "
                                   f"learned weights, or a topology.json")
        path = path / "topology.json"
    try:
        P = load_topology_json(path)
    except (ValueError, TypeError) as err:  # a ragged or non-numeric matrix (UserErrors pass through)
        if isinstance(err, UserError):
            raise
        raise UserError(f"{path} is not a topology JSON with a square 'probabilities' matrix ({err})") from None
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise UserError(f"{path} holds a {tuple(P.shape)} 'probabilities' array; a topology is a square "
                        "(K, K) matrix, as written at each checkpoint")
    out = args.out or path.with_suffix(".png")
    plot_topology_heatmap(P, out, title=args.title)
    summary = topology_summary(P)
    print(format_topology_summary(summary))
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_text(json.dumps(summary, indent=1))
        print(f"summary written to {args.summary_json}")
    print(f"heatmap written to {out}")


def compare(args) -> None:
    from ancre_dit.figures import plot_topology_panels

    topologies = {name: load_topology(p) for name, p in zip(_names(args.topologies), args.topologies)}
    result = compare_topologies(topologies)
    print(format_comparison(result))
    png = plot_topology_panels(topologies, args.out, title="learned topologies (rows: target block, columns: source)")
    print(f"heatmaps written to {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"comparison written to {args.json}")


def prune(args) -> None:
    P = load_topology(args.topology)
    pruned = prune_topology(P, top_k=args.top_k, threshold=args.threshold)
    rule = f"top-{args.top_k}" if args.top_k is not None else f"threshold {args.threshold:g}"
    kept, before = int((pruned > 0).sum()), int((P > 0).sum())
    write_topology(args.out, pruned, source=str(args.topology), pruned=rule)
    print(f"kept {kept} of {before} edges ({rule}, rows renormalised); written to {args.out}\n"
          f"train it with: model.topology=frozen model.topology_path={args.out}")


def evolution(args) -> None:
    from ancre_dit.figures import plot_topology_panels, save_topology_gif

    frames = {f"step {step}": P for step, P in checkpoint_topologies(args.run)}
    out = args.out or args.run / "topology_evolution.png"
    plot_topology_panels(frames, out, title=f"{args.run.name}: topology (EMA) at each checkpoint")
    print(f"{len(frames)} checkpoints drawn to {out}")
    if args.gif:
        save_topology_gif(frames, args.gif)
        print(f"animation written to {args.gif}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("show", help="heatmap PNG of one topology, and its per-block summary")
    s.add_argument("topology", type=Path, metavar="RUN_OR_JSON",
                   help="a run directory or a topology.json (a 'probabilities' (K, K) matrix)")
    s.add_argument("--out", type=Path, default=None, help="heatmap PNG (default: next to the JSON)")
    s.add_argument("--title", default=None)
    s.add_argument("--summary-json", type=Path, default=None,
                   help="also write the topology analysis (strongest sources, anchors, entropy) here")
    s.set_defaults(func=show)
    c = sub.add_parser("compare", help="Pearson correlation and strongest-edge agreement between runs")
    c.add_argument("topologies", type=Path, nargs="+", metavar="RUN_OR_JSON")
    c.add_argument("--out", type=Path, default=Path("topology_compare.png"), help="side-by-side heatmaps (PNG)")
    c.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    c.set_defaults(func=compare)
    r = sub.add_parser("prune", help="keep each block's strongest incoming edges -> topology.json for 'frozen'")
    r.add_argument("topology", type=Path, metavar="RUN_OR_JSON")
    r.add_argument("--top-k", type=int, default=None, help="edges kept per block")
    r.add_argument("--threshold", type=float, default=None, help="keep edges of at least this weight")
    r.add_argument("--out", type=Path, required=True, help="topology.json to write")
    r.set_defaults(func=prune)
    e = sub.add_parser("evolution", help="the topology at each checkpoint of a run, as one image strip")
    e.add_argument("run", type=Path, metavar="RUN")
    e.add_argument("--out", type=Path, default=None, help="PNG strip (default RUN/topology_evolution.png)")
    e.add_argument("--gif", type=Path, default=None, help="also write an animated GIF here")
    e.set_defaults(func=evolution)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare" and len(args.topologies) < 2:
        raise UserError("compare needs at least two runs or topology.json files")
    args.func(args)
    return 0


if __name__ == "__main__":
    run_cli(main)
