"""Comparing training runs: curves of every logged metric, seed groups, steps to a target, speedups.

Reads only what any run writes (config.yaml, logs/metrics.jsonl, logs/evals.jsonl), whatever its
topology or objective. Metrics: `train_loss` (metrics.jsonl's loss) and every key of the evals'
"metrics" (held-out loss, digits_* or fid/... per cfg scale). Runs of a group (seeds of one
setting) are aggregated per step as mean and standard deviation (ddof=1) over the runs that have
that step; a group's curve keeps only the steps every member has.

Steps to target: the first step at which a group's mean curve reaches the target (<= for metrics
where lower is better, >= otherwise); the default target of a metric is the first group's final
mean value. Speedup of a group = the first group's steps to target / this group's; None when
either never reaches it.
"""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from ..errors import UserError
from ..files import read_jsonl
from .evaluator import is_lower_better, read_evals

AXES = {"step": "step", "images": "images seen", "seconds": "training seconds (evaluation excluded)"}


@dataclass
class Series:
    """One metric of one run: values at steps, with images seen and training seconds (NaN if unknown)."""
    step: np.ndarray
    value: np.ndarray
    images: np.ndarray
    seconds: np.ndarray


@dataclass
class Run:
    name: str
    path: Path
    config: dict[str, Any]
    series: dict[str, Series] = field(default_factory=dict)


def _series(points: dict[int, tuple[float, float, float]]) -> Series:
    steps = sorted(points)
    cols = np.array([points[s] for s in steps], dtype=np.float64).reshape(len(steps), 3)
    return Series(np.asarray(steps), cols[:, 0], cols[:, 1], cols[:, 2])


def load_run(path: str | Path) -> Run:
    """A run directory's curves; a UserError when it holds neither metrics.jsonl nor evals.jsonl."""
    path = Path(path)
    config_file = path / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"{config_file} is not valid YAML ({' '.join(str(err).split())[:120]}); repair it or leave "
                        f"that run out") from None
    if config is not None and not isinstance(config, dict):
        raise UserError(f"{config_file} holds no config mapping; repair it or leave that run out")
    batch = int(((config or {}).get("train") or {}).get("global_batch_size") or 0)
    run = Run(path.name, path, config or {})

    def point(row: dict[str, Any], value: float) -> tuple[float, float, float]:
        images = row.get("images_seen", row["step"] * batch if batch else None)
        seconds = row.get("train_seconds")
        return (float(value), np.nan if images is None else float(images), np.nan if seconds is None else float(seconds))

    loss = {int(r["step"]): point(r, r["loss"]) for r in read_jsonl(path / "logs" / "metrics.jsonl") if "loss" in r}
    if loss:
        run.series["train_loss"] = _series(loss)
    evals = read_evals(path)
    if evals:  # one evaluation setting per run: the latest one's (a re-evaluation with new settings wins)
        settings = evals[-1].get("settings")
        by_metric: dict[str, dict[int, tuple]] = {}
        for row in evals:
            if row.get("settings") != settings:
                continue
            for k, v in row["metrics"].items():
                by_metric.setdefault(k, {})[int(row["step"])] = point(row, v)
        run.series.update({k: _series(v) for k, v in by_metric.items()})
    if not run.series:
        raise UserError(f"{path} holds no logs/metrics.jsonl or logs/evals.jsonl; pass run directories written by train.py")
    return run


@dataclass
class Group:
    label: str
    runs: list[Run]

    def curve(self, metric: str, axis: str = "step") -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """(x, mean, std or None) over the steps every member has; None when a member lacks the metric."""
        members = [r.series.get(metric) for r in self.runs]
        if any(s is None for s in members):
            return None
        steps = sorted(set.intersection(*(set(s.step.tolist()) for s in members)))
        if not steps:
            return None
        rows = [np.searchsorted(s.step, steps) for s in members]
        values = np.stack([s.value[i] for s, i in zip(members, rows)])
        if axis == "step":
            x = np.asarray(steps, dtype=np.float64)
        else:  # NaN where any member lacks the axis (e.g. runs from before train_seconds was logged)
            x = np.stack([getattr(s, axis)[i] for s, i in zip(members, rows)]).mean(axis=0)
        std = values.std(axis=0, ddof=1) if len(members) > 1 else None
        return x, values.mean(axis=0), std


def group_runs(runs: Sequence[Run], patterns: Sequence[str] = ()) -> list[Group]:
    """Groups in the order of their first run. With patterns: runs whose directory name matches
    a pattern (fnmatch) form its group, others stay alone. Without: runs whose configs are equal
    once run_dir and train.seed are removed form a group."""
    groups: dict[str, list[Run]] = {}
    labels: dict[str, str] = {}
    for run in runs:
        if patterns:
            key = next((p for p in patterns if fnmatch.fnmatch(run.name, p)), f"run:{run.path}")
        else:
            config = json.loads(json.dumps(run.config))  # a deep copy
            config.pop("run_dir", None)
            (config.get("train") or {}).pop("seed", None)
            key = json.dumps(config, sort_keys=True)
        groups.setdefault(key, []).append(run)
    for key, members in groups.items():
        if len(members) == 1:
            labels[key] = members[0].name
        elif patterns and not key.startswith("run:"):
            labels[key] = key
        else:
            prefix = os.path.commonprefix([r.name for r in members]).rstrip("-_ ")
            labels[key] = f"{prefix}* ({len(members)} runs)" if prefix else f"{members[0].name} +{len(members) - 1}"
    return [Group(labels[k], v) for k, v in groups.items()]


def steps_to_target(steps: np.ndarray, values: np.ndarray, target: float, lower_is_better: bool) -> int | None:
    """The first step whose value reaches `target`; None if none does."""
    reached = values <= target if lower_is_better else values >= target
    hits = np.flatnonzero(reached)
    return int(steps[hits[0]]) if len(hits) else None


@dataclass
class MetricRow:
    group: str
    final_step: int
    final_mean: float
    final_std: float | None
    steps_to_target: int | None
    speedup: float | None


def summarize(groups: Sequence[Group], targets: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """metric -> {"target", "lower_is_better", "rows": [MetricRow per group that has the metric]}."""
    targets = dict(targets or {})
    metrics = list(dict.fromkeys(m for g in groups for r in g.runs for m in r.series))
    out: dict[str, dict[str, Any]] = {}
    for metric in metrics:
        curves = [(g, g.curve(metric)) for g in groups]
        curves = [(g, c) for g, c in curves if c is not None]
        if not curves:
            continue
        lower = is_lower_better(metric)
        target = targets.get(metric, float(curves[0][1][1][-1]))
        rows = []
        for g, (x, mean, std) in curves:
            rows.append(MetricRow(g.label, int(x[-1]), float(mean[-1]), None if std is None else float(std[-1]),
                                  steps_to_target(x, mean, target, lower), None))
        base = rows[0].steps_to_target if curves[0][0] is groups[0] else None
        for row in rows:
            if base is not None and row.steps_to_target:
                row.speedup = base / row.steps_to_target
        out[metric] = {"target": target, "lower_is_better": lower, "rows": rows}
    return out


def _fmt(v: float | None, std: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g} ± {std:.2g}" if std is not None else f"{v:.4g}"


def markdown_report(groups: Sequence[Group], summary: dict[str, dict[str, Any]]) -> str:
    lines = ["# Run comparison", "", "Groups (mean ± std over the runs of a group, ddof=1):", ""]
    for g in groups:
        lines.append(f"- **{g.label}**: {', '.join(r.name for r in g.runs)}")
    lines += ["", f"Target of each metric: the first group's ({groups[0].label}) final mean unless given; "
              "steps to target = first evaluated step where the mean curve reaches it; speedup = first group's "
              "steps to target / this group's. Metrics named digits_* are the digits classifier metric, NOT FID.", ""]
    for metric, info in summary.items():
        arrow = "lower is better" if info["lower_is_better"] else "higher is better"
        lines += [f"## {metric} ({arrow}; target {info['target']:.4g})", "",
                  "| group | final step | final value | steps to target | speedup |", "|---|---|---|---|---|"]
        for row in info["rows"]:
            reached = str(row.steps_to_target) if row.steps_to_target is not None else f"not reached by {row.final_step}"
            speed = f"{row.speedup:.2f}x" if row.speedup is not None else "-"
            lines.append(f"| {row.group} | {row.final_step} | {_fmt(row.final_mean, row.final_std)} | {reached} | {speed} |")
        lines.append("")
    return "\n".join(lines)


def write_report(run_dirs: Sequence[str | Path], out: str | Path, patterns: Sequence[str] = (),
                 targets: dict[str, float] | None = None) -> dict[str, Any]:
    """Loads the runs, writes OUT/report.md, OUT/summary.json and OUT/curves_<axis>.png; returns the summary."""
    from ..figures import plot_panels

    if not run_dirs:
        raise UserError("pass at least one run directory")
    missing = [str(p) for p in run_dirs if not Path(p).is_dir()]
    if missing:
        raise UserError(f"run directory {missing[0]} does not exist")
    seen: dict[Path, str] = {}
    for p in run_dirs:  # the same run twice would pass for a two-seed group with zero spread
        if Path(p).resolve() in seen:
            raise UserError(f"run {p} is given twice (also as {seen[Path(p).resolve()]}); pass each run once")
        seen[Path(p).resolve()] = str(p)
    runs = [load_run(p) for p in run_dirs]
    known = sorted({m for run in runs for m in run.series})
    unknown = sorted(set(targets or {}) - set(known))
    if unknown:
        raise UserError(f"--target {unknown[0]}: no run has that metric; the runs have {', '.join(known)}")
    groups = group_runs(runs, patterns)
    summary = summarize(groups, targets)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown_report(groups, summary))
    (out / "summary.json").write_text(json.dumps({m: {**{k: v for k, v in info.items() if k != "rows"},
                                                       "rows": [vars(r) for r in info["rows"]]}
                                                   for m, info in summary.items()}, indent=1))
    for axis, label in AXES.items():
        panels = {}
        for metric in summary:
            if metric.startswith(("heldout_mse", "heldout_vb")):  # parts of heldout_loss: table only
                continue
            curves = {g.label: c for g in groups if (c := g.curve(metric, axis)) is not None and np.isfinite(c[0]).all()}
            if curves:
                panels[metric] = curves
        if panels:
            plot_panels(panels, out / f"curves_{axis}.png", xlabel=label)
    return summary
