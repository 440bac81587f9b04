#!/usr/bin/env python3
"""Learned topologies: draw one, compare runs, prune to a sparse frozen topology, watch one evolve,
and diagnose how any checkpoint moves information through depth.

    python scripts/topology.py show RUN_OR_JSON [--out heatmap.png] [--title T] [--summary-json F]
    python scripts/topology.py show DAR_OR_ATTNRES_RUN [--t 0.1 0.5 0.9] [--out routing.png | --out DIR]
    python scripts/topology.py compare RUN_A RUN_B RUN_C [--out compare.png] [--json compare.json]
    python scripts/topology.py prune RUN_OR_JSON --top-k 2 --out sparse.json   (or --threshold 0.1)
    python scripts/topology.py evolution RUN [--out evolution.png] [--gif evolution.gif]
    python scripts/topology.py diagnose RUN_OR_CKPT [--t 0.1 0.5 0.9] --out DIR

A RUN_OR_JSON is a run directory (its newest topology.json) or a topology.json file. `show` draws
the heatmap (default: next to the JSON) and prints the per-block summary (strongest sources,
anchors, entropy). For DAR and AttnRes, whose weights depend on the token and the time, `show`
draws the mean weights (aggregator x source) on a fixed probe batch at each --t. `compare` reports
the Pearson correlation of the learned edge weights (blocks 2..K; block 1's single edge is always 1)
and how often the strongest incoming edge of a block comes from the same source; a pruned file trains with `model.topology=frozen model.topology_path=sparse.json`.
A plain DiT (all-zero topology) has no routing to compare, prune or follow, and is refused.
`diagnose` works for every topology (HC and mHC included): on a fixed batch at each normalised time
t (0 = data, 1 = noise) it measures forward inflation (RMS of the state after each block), backward
decay (RMS of the loss gradient there), redundancy (cosine of adjacent states) and how linearly t
can be read from each state, into DIR/diagnose.json and DIR/diagnose.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ancre_dit.cli import CommandParser, output_file, output_folder, run_cli
from ancre_dit.errors import MissingFileError, UserError
from ancre_dit.models import load_topology_json
from ancre_dit.models.topologies.analysis import (checkpoint_topologies, compare_topologies, format_comparison,
                                                  format_topology_summary, load_topology, prune_topology,
                                                  topology_file, topology_summary, write_topology)


def _names(paths: list[Path]) -> list[str]:
    """Short unique labels: the file or run name, with its parent folder where names repeat."""
    names = [p.stem if p.is_file() and p.name != "topology.json" else (p.parent.name if p.is_file() else p.name)
             for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def _write_text(path: Path, text: str, what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"{what} written to {path}")


def show(args) -> None:
    from ancre_dit.figures import plot_topology_heatmap

    if _attends_over_depth(args.topology):
        return show_routing(args)
    path = topology_file(args.topology)
    P = load_topology_json(path)
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise UserError(f"{path} holds a {tuple(P.shape)} 'probabilities' array; a topology is a square "
                        "(K, K) matrix, as written at each checkpoint")
    out = output_file(args.out or path.with_suffix(".png"), (".png",))
    if args.summary_json:
        output_file(args.summary_json, (".json",), "--summary-json")
    plot_topology_heatmap(P, out, title=args.title)
    summary = topology_summary(P)
    print(format_topology_summary(summary))
    if args.summary_json:
        _write_text(args.summary_json, json.dumps(summary, indent=1), "summary")
    print(f"heatmap written to {out}")


def _checkpoint_of(path: Path) -> Path:
    """A checkpoint folder, or a run's newest complete checkpoint."""
    from ancre_dit.training.checkpointing import list_checkpoints

    if (path / "model_spec.json").is_file():
        return path
    found = list_checkpoints(path) if path.is_dir() else []
    if not found:
        raise MissingFileError(f"{path} is neither a checkpoint folder nor a run with a complete checkpoint; "
                               f"pass RUN or RUN/checkpoints/<step>")
    return found[-1][1]


def _attends_over_depth(path: Path) -> bool:
    """A run or checkpoint of a topology whose weights depend on the token and the timestep (DAR,
    AttnRes: no topology.json), as its registry entry declares."""
    from ancre_dit.checkpoint import load_model_spec
    from ancre_dit.models.topologies import topology_entry

    if not path.is_dir() or (path / "topology.json").is_file():
        return False
    try:
        name = load_model_spec(_checkpoint_of(path))["model"]["kwargs"].get("topology")
        return name is not None and topology_entry(name).weights_per_time
    except UserError:
        return False


def show_routing(args) -> None:
    """DAR / AttnRes: the mean routing weights (aggregator x source, over samples and tokens) on a
    fixed probe batch, one heatmap per normalised time t, since the weights depend on t."""
    import torch

    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.diffusion import build_objective
    from ancre_dit.evaluation.diagnostics import fixed_draws
    from ancre_dit.figures import plot_topology_panels

    # --out X.png: all times as panels of one figure; --out DIR: that figure as DIR/routing.png, one
    # heatmap per time (DIR/routing_t<t>.png) and the weights (DIR/routing_weights.json).
    folder_out = args.out is not None and (args.out.is_dir() or not args.out.suffix)
    if folder_out:
        out_dir = output_folder(args.out, "routing drawing", "routing*.png")
        out = out_dir / "routing.png"
    else:
        out = output_file(args.out or args.topology / "routing.png", (".png",))
    if args.summary_json:
        output_file(args.summary_json, (".json",), "--summary-json")
    folder = _checkpoint_of(args.topology)
    model, spec = load_trained_model(folder)
    objective = build_objective(spec["diffusion"])
    x, y, source = _probe_batch(spec, model, 32, 0)
    weights = {}
    model.topology.record_weights = True
    with torch.no_grad():
        for u, draw in fixed_draws(objective, x, args.t):
            objective.losses(model, x, y, draw)
            weights[f"t={u:g}"] = model.topology.routing_weights()
    model.topology.record_weights = False
    title = (f"{spec['model']['kwargs'].get('topology')} step {spec.get('step')}: rows = aggregator before sublayer "
             f"l+1 (last: final), columns = source v_i ({source})")
    plot_topology_panels(weights, out, title=title)
    numbers = json.dumps({k: v.tolist() for k, v in weights.items()}, indent=1)
    if folder_out:
        for name, W in weights.items():
            plot_topology_panels({name: W}, out_dir / f"routing_{name.replace('=', '')}.png", title=title)
        (out_dir / "routing_weights.json").write_text(numbers)
    if args.summary_json:
        _write_text(args.summary_json, numbers, "weights")
    where = f"{out_dir} (routing.png, one routing_t<t>.png per time, routing_weights.json)" if folder_out else out
    print(f"routing weights of {folder} at t = {', '.join(f'{t:g}' for t in args.t)} drawn to {where}")


def compare(args) -> None:
    from ancre_dit.figures import plot_topology_panels

    output_file(args.out, (".png",))
    if args.json:
        output_file(args.json, (".json",), "--json")
    topologies = {name: load_topology(p) for name, p in zip(_names(args.topologies), args.topologies)}
    result = compare_topologies(topologies)
    print(format_comparison(result))
    png = plot_topology_panels(topologies, args.out, title="learned topologies (rows: target block, columns: source)")
    print(f"heatmaps written to {png}")
    if args.json:
        _write_text(args.json, json.dumps(result, indent=1), "comparison")


def prune(args) -> None:
    output_file(args.out, (".json",))
    P = load_topology(args.topology)
    pruned = prune_topology(P, top_k=args.top_k, threshold=args.threshold)
    rule = f"top-{args.top_k}" if args.top_k is not None else f"threshold {args.threshold:g}"
    kept, before = int((pruned > 0).sum()), int((P > 0).sum())
    write_topology(args.out, pruned, source=str(args.topology), pruned=rule)
    print(f"kept {kept} of {before} edges ({rule}, rows renormalised); written to {args.out}\n"
          f"train it with: model.topology=frozen model.topology_path={args.out}")


def evolution(args) -> None:
    from ancre_dit.figures import plot_topology_panels, save_topology_gif

    out = output_file(args.out or args.run / "topology_evolution.png", (".png",))
    if args.gif:
        output_file(args.gif, (".gif",), "--gif")
    frames = {f"step {step}": P for step, P in checkpoint_topologies(args.run)}
    plot_topology_panels(frames, out, title=f"{args.run.name}: topology (EMA) at each checkpoint")
    print(f"{len(frames)} checkpoints drawn to {out}")
    if args.gif:
        save_topology_gif(frames, args.gif)
        print(f"animation written to {args.gif}")


def diagnose(args) -> None:
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.diffusion import build_objective
    from ancre_dit.evaluation.diagnostics import diagnose as measure
    from ancre_dit.figures import plot_diagnosis

    out = output_folder(args.out, "diagnosis", "diagnose.json")
    folder = _checkpoint_of(args.checkpoint)
    model, spec = load_trained_model(folder, args.weights)
    objective = build_objective(spec["diffusion"])
    x, y, source = _probe_batch(spec, model, args.samples, args.seed)
    result = {"checkpoint": str(folder), "step": spec.get("step"), "weights": args.weights, "inputs": source,
              "topology": spec["model"]["kwargs"].get("topology", "cascaded"),
              **measure(model, objective, x, y, list(args.t), seed=args.seed)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.json").write_text(json.dumps(result, indent=1))
    plot_diagnosis(result, out / "diagnose.png")
    for t, profile in result["profiles"].items():
        print(f"t={t}: RMS z_0 {profile['rms'][0]:.3g} -> z_K {profile['rms'][-1]:.3g} "
              f"(x{profile['rms'][-1] / profile['rms'][0]:.3g}), gradient RMS z_0/z_K "
              f"{profile['grad_rms'][0] / max(profile['grad_rms'][-1], 1e-30):.3g}, "
              f"mean adjacent cosine {sum(profile['cosine']) / len(profile['cosine']):.3f}")
    if result["time_probe_r2"] is not None:
        print("time probe R^2 by depth: " + " ".join(f"{r:.2f}" for r in result["time_probe_r2"]))
    print(f"diagnosis of {folder} ({source}) written to {out}/diagnose.json and diagnose.png")


def _probe_batch(spec: dict, model, count: int, seed: int):
    """The digits' held-out images for digits models; for others, N(0, 1) stand-ins of the model's
    input shape (the diagnostics need no real data to compare depth profiles)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if spec.get("data", {}).get("kind") == "digits":
        from ancre_dit.data.digits import DigitsDataset

        held = DigitsDataset("heldout")
        items = [held[i] for i in range(min(count, len(held)))]
        return (torch.stack([torch.as_tensor(i[0]) for i in items]).float(),
                torch.tensor([int(i[1]) for i in items]), "held-out digits")
    size = model.input_size
    x = torch.randn(count, model.in_channels, size, size, generator=g)
    return x, torch.randint(0, model.num_classes, (count,), generator=g), "N(0, 1) stand-in inputs"


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("show", help="heatmap PNG of one topology, and its per-block summary")
    s.add_argument("topology", type=Path, metavar="RUN_OR_JSON",
                   help="a run directory or a topology.json (a 'probabilities' (K, K) matrix)")
    s.add_argument("--out", type=Path, default=None,
                   help="heatmap PNG (default: next to the JSON); DAR / AttnRes also take a folder: one heatmap "
                        "per --t there")
    s.add_argument("--title", default=None)
    s.add_argument("--summary-json", type=Path, default=None,
                   help="also write the topology analysis (strongest sources, anchors, entropy) here")
    s.add_argument("--t", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                   help="DAR / AttnRes: normalised times (0 = data, 1 = noise) at which to draw the weights")
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
    d = sub.add_parser("diagnose", help="forward inflation, gradient decay, redundancy and a time probe, any topology")
    d.add_argument("checkpoint", type=Path, metavar="RUN_OR_CKPT", help="a run (its newest checkpoint) or a checkpoint")
    d.add_argument("--t", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="normalised times (0 = data, 1 = noise)")
    d.add_argument("--samples", type=int, default=32, help="examples in the fixed batch")
    d.add_argument("--weights", choices=("ema", "model"), default="ema")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", type=Path, required=True, help="folder for diagnose.json and diagnose.png")
    d.set_defaults(func=diagnose)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare" and len(args.topologies) < 2:
        raise UserError("compare needs at least two runs or topology.json files")
    if not all(0.0 <= t <= 1.0 for t in getattr(args, "t", [])):  # show and diagnose alike
        raise UserError(f"--t takes normalised times in [0, 1] (0 = data, 1 = noise), got {' '.join(map(str, args.t))}")
    if getattr(args, "samples", 1) < 1:
        raise UserError(f"--samples {args.samples} must be at least 1 (the examples of the probe batch)")
    if getattr(args, "seed", 0) < 0:
        raise UserError(f"--seed {args.seed} must be a non-negative integer")
    args.func(args)
    return 0


if __name__ == "__main__":
    run_cli(main)
