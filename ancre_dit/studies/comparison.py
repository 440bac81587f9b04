"""Comparing runs (`scripts/compare_runs.py`, a study's report): steps to a target, speedup, verdict, curves.
Groups meet their baseline seed by seed (one seed: the same data order and noise). Seed s's target is the
baseline's final value for s (or a given one): a mean curve's would mix seeds that never reach it with seeds
that do. The geometric mean of speedup_s = baseline steps_s / group steps_s gets a Student-t interval on the
log speedups; a seed whose group never reaches the target is censored."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UserError
from ..evaluation.metric_registry import is_heldout_part, lower_is_better as is_lower_better
from ..evaluation.stats import MeanInterval, mean_t_interval
from .run_curves import AXES, Group, Run, Series, group_runs, load_run

LEVEL = 0.95


def steps_to_target(steps: np.ndarray, values: np.ndarray, target: float, lower_is_better: bool) -> int | None:
    """The first step whose value reaches `target`; None if none does."""
    hits = np.flatnonzero(values <= target if lower_is_better else values >= target)
    return int(steps[hits[0]]) if len(hits) else None


def interval_curve(group: Group, metric: str, axis: str = "step"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(x, mean over the runs, half width of its t interval or None for one run); None when a run lacks the metric."""
    found = group.aligned(metric, axis)
    if found is None:
        return None
    x, values = found
    if len(group.runs) < 2:
        return x, values[0], None
    columns = [mean_t_interval(column, LEVEL) for column in values.T]
    return x, np.array([c.mean for c in columns]), np.array([c.high - c.mean for c in columns])


@dataclass
class SeedSpeedup:
    """One seed's steps to the target on both sides and their ratio; censored below `bound` = baseline steps
    / the arm's last step when the arm never reaches it."""
    seed: int
    target: float
    baseline_steps: int | None
    arm_steps: int | None
    arm_final_step: int
    speedup: float | None
    bound: float | None


@dataclass
class PairedSpeedup:
    """Per-seed speedups and their geometric mean with its interval (None unless every seed has a
    speedup; low/high also need >= 2 seeds). target None: each seed's is the baseline's final value."""
    metric: str
    lower_is_better: bool
    seeds: list[SeedSpeedup]
    geomean: float | None
    low: float | None
    high: float | None
    level: float
    target: float | None = None

    @property
    def reached(self) -> int:
        return sum(s.arm_steps is not None for s in self.seeds)


def _pairs(baseline: Sequence[Run], arm: Sequence[Run], metric: str) -> list[tuple[int, Series, Series]]:
    def by_seed(runs: Sequence[Run]) -> dict[int, Run]:
        out: dict[int, Run] = {}
        for run in runs:
            if run.seed is None:
                raise UserError(f"{run.path}/config.yaml gives no train.seed; seed-paired statistics need it")
            if run.seed in out:
                raise UserError(f"runs {out[run.seed].path} and {run.path} share train.seed={run.seed}; a "
                                f"seed-paired comparison needs one run per seed")
            out[run.seed] = run
        return out

    base_runs, arm_runs = by_seed(baseline), by_seed(arm)
    found = [(seed, base_runs[seed].series.get(metric), arm_runs[seed].series.get(metric))
             for seed in sorted(set(base_runs) & set(arm_runs))]
    return [(seed, base, other) for seed, base, other in found
            if base is not None and other is not None and len(base.step) and len(other.step)]


def paired_speedup(baseline: Sequence[Run], arm: Sequence[Run], metric: str, target: float | None = None
                   ) -> PairedSpeedup | None:
    """Steps to the target and their ratio, seed by seed; None when no seed has the metric on both sides."""
    lower = is_lower_better(metric)
    seeds: list[SeedSpeedup] = []
    for seed, base, other in _pairs(baseline, arm, metric):
        goal = float(base.value[-1]) if target is None else float(target)
        base_steps = steps_to_target(base.step, base.value, goal, lower)
        arm_steps = steps_to_target(other.step, other.value, goal, lower)
        final = int(other.step[-1])
        both = base_steps is not None and arm_steps is not None
        seeds.append(SeedSpeedup(seed, goal, base_steps, arm_steps, final, base_steps / arm_steps if both else None,
                                 base_steps / final if base_steps is not None and arm_steps is None else None))
    if not seeds:
        return None
    if any(s.speedup is None for s in seeds):
        return PairedSpeedup(metric, lower, seeds, None, None, None, LEVEL, target)
    logs = mean_t_interval([math.log(s.speedup) for s in seeds], LEVEL)
    low, high = (None, None) if logs.low is None else (math.exp(logs.low), math.exp(logs.high))
    return PairedSpeedup(metric, lower, seeds, math.exp(logs.mean), low, high, LEVEL, target)


def paired_difference(baseline: Sequence[Run], arm: Sequence[Run], metric: str) -> MeanInterval | None:
    """Arm's final value minus the baseline's, seed by seed, with the t interval of its mean."""
    diffs = [float(other.value[-1]) - float(base.value[-1]) for _, base, other in _pairs(baseline, arm, metric)]
    return mean_t_interval(diffs, LEVEL) if diffs else None


def _x(v: float) -> str:
    return f"{v:.3g}x"


def verdict(result: PairedSpeedup) -> str:
    """Faster / slower when the interval excludes 1 (or most seeds of one side miss the target), else no difference."""
    what = "the baseline's final value" if result.target is None else f"the target {result.target:.4g}"
    n = len(result.seeds)
    arm_only = sum(s.arm_steps is None and s.baseline_steps is not None for s in result.seeds)
    base_only = sum(s.baseline_steps is None and s.arm_steps is not None for s in result.seeds)
    neither = sum(s.baseline_steps is None and s.arm_steps is None for s in result.seeds)
    if arm_only * 2 > n:
        return f"slower: {what} not reached by {arm_only} of {n} seeds"
    if base_only * 2 > n:
        return f"faster: {what} reached by {base_only} of {n} seeds whose baseline does not reach it"
    if arm_only or base_only or neither:
        missing = [text for count, text in ((arm_only, f"not reached by {arm_only} of {n} seeds"),
                                            (base_only, f"not reached by the baseline for {base_only} of {n} seeds"),
                                            (neither, f"reached by neither for {neither} of {n} seeds")) if count]
        return f"no difference detected at this budget ({'; '.join(missing)}: no interval)"
    if result.low is None:
        return f"no difference detected at this budget ({n} seed: no interval; speedup {_x(result.geomean)})"
    span = f"[{result.low:.3g}, {result.high:.3g}]"
    if result.low > 1:
        return f"faster by {_x(result.geomean)} {span}"
    if result.high < 1:
        return f"slower by {_x(1 / result.geomean)} [{1 / result.high:.3g}, {1 / result.low:.3g}]"
    return f"no difference detected at this budget (speedup {_x(result.geomean)} {span})"


@dataclass
class MetricRow:
    """One group's final values for one metric and, unless a baseline, its paired comparison."""
    group: str
    seeds: int  # runs of the group that have the metric
    final_step: int  # the latest last step of those runs
    final: MeanInterval
    difference: MeanInterval | None
    speedup: PairedSpeedup | None
    verdict: str


def metric_rows(groups: Sequence[Group], metric: str, baseline_of: Callable[[str], str], target: float | None = None
                ) -> list[MetricRow]:
    """A row per group that has the metric, against group `baseline_of(label)` (itself for a baseline)."""
    by_label = {g.label: g for g in groups}
    rows = []
    for group in groups:
        finals = [(int(s.step[-1]), float(s.value[-1])) for r in group.runs
                  if (s := r.series.get(metric)) is not None and len(s.step)]
        if not finals:
            continue
        row = MetricRow(group.label, len(finals), max(step for step, _ in finals),
                        mean_t_interval([v for _, v in finals], LEVEL), None, None, "baseline")
        base = by_label.get(baseline_of(group.label))
        if base is None:
            row.verdict = "the baseline has no finished run yet"
        elif base is not group:
            row.difference = paired_difference(base.runs, group.runs, metric)
            row.speedup = paired_speedup(base.runs, group.runs, metric, target)
            row.verdict = verdict(row.speedup) if row.speedup is not None else "no seed paired with the baseline"
        rows.append(row)
    return rows


def step_intervals(groups: Sequence[Group], metric: str
                   ) -> dict[str, dict[int, tuple[float, float | None, float | None]]]:
    """group -> step -> (mean, low, high) over the group's seeds (low/high None for one run)."""
    out = {}
    for group in groups:
        if (curve := interval_curve(group, metric)) is not None:
            x, mean, half = curve
            bounds = [(None, None)] * len(x) if half is None else zip((mean - half).tolist(), (mean + half).tolist())
            out[group.label] = {int(step): (float(m), low, high) for step, m, (low, high) in zip(x, mean, bounds)}
    return out


def row_summary(row: MetricRow) -> dict[str, Any]:
    def interval(mi: MeanInterval | None) -> dict[str, Any] | None:
        return None if mi is None else {"mean": mi.mean, "low": mi.low, "high": mi.high, "n": mi.n}

    speedup = row.speedup
    return {"seeds": row.seeds, "final": interval(row.final), "difference": interval(row.difference),
            "verdict": row.verdict,
            "speedup": None if speedup is None else {"geomean": speedup.geomean, "low": speedup.low,
                                                     "high": speedup.high, "per_seed": [vars(s) for s in speedup.seeds]}}


def write_curves(groups: Sequence[Group], metrics: Sequence[str], folder: Path, title: str) -> list[str]:
    """Writes folder/curves_<axis>.png (mean over seeds, t interval band) per axis, stale ones removed; returns the names."""
    from ..figures import plot_panels

    for old in folder.glob("curves_*.png"):
        old.unlink()
    written = []
    for axis, label in AXES.items():
        panels = {metric: {g.label: c for g in groups
                           if (c := interval_curve(g, metric, axis)) is not None and np.isfinite(c[0]).all()}
                  for metric in metrics if not is_heldout_part(metric)}
        if panels := {metric: curves for metric, curves in panels.items() if curves}:
            name = f"curves_{axis}.png"
            plot_panels(panels, folder / name, xlabel=label, title=title)
            written.append(name)
    return written


def summarize(groups: Sequence[Group], targets: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """metric -> {"target", "lower_is_better", "rows"}: every group against the first one."""
    targets = targets or {}
    rows = {metric: metric_rows(groups, metric, lambda _label: groups[0].label, targets.get(metric))
            for metric in dict.fromkeys(m for g in groups for r in g.runs for m in r.series)}
    return {metric: {"target": targets.get(metric), "lower_is_better": is_lower_better(metric), "rows": found}
            for metric, found in rows.items() if found}


def _table_row(row: MetricRow) -> str:
    """A row of run comparison's table: group, final step, mean ± std, steps to target, speedup, verdict."""
    final, result, steps, speedup = row.final, row.speedup, "-", "-"
    if result is not None:
        cells = [str(s.arm_steps) if s.arm_steps is not None else f"not reached by {s.arm_final_step}"
                 for s in result.seeds]
        steps = cells[0] if len(cells) == 1 else "; ".join(f"s{s.seed}: {c}" for s, c in zip(result.seeds, cells))
    if result is not None and result.geomean is not None:
        speedup = f"{result.geomean:.2f}x" + ("" if result.low is None else f" [{result.low:.2f}, {result.high:.2f}]")
    value = f"{final.mean:.4g}" if final.std is None else f"{final.mean:.4g} ± {final.std:.2g}"
    return f"| {row.group} | {row.final_step} | {value} | {steps} | {speedup} | {row.verdict} |"


def markdown_report(groups: Sequence[Group], summary: dict[str, dict[str, Any]]) -> str:
    lines = ["# Run comparison", "", "Groups (final value: mean ± std over the runs of a group, ddof=1):", ""]
    lines += [f"- **{g.label}**: {', '.join(r.name for r in g.runs)}" for g in groups]
    lines += ["", f"Every group is compared with the first ({groups[0].label}) seed by seed (train.seed): the "
              "target of a seed is the baseline's final value for that seed unless given; steps to target = the "
              "first evaluated step at which a run reaches it; speedup = the baseline's steps / the group's, as "
              f"the geometric mean over seeds with a {LEVEL:.0%} Student-t interval on the log speedups; the "
              "verdict reads that interval (faster / slower when it excludes 1). Metrics named digits_* are the "
              "digits metric (SVC accuracy, pixel Fréchet distance), NOT FID.", ""]
    for metric, info in summary.items():
        arrow = "lower is better" if info["lower_is_better"] else "higher is better"
        target = "the baseline's final value, per seed" if info["target"] is None else f"{info['target']:.4g}"
        lines += [f"## {metric} ({arrow}; target {target})", "",
                  "| group | final step | final value | steps to target | speedup | verdict |",
                  "|---|---|---|---|---|---|"]
        lines += [_table_row(row) for row in info["rows"]] + [""]
    return "\n".join(lines)


def write_report(run_dirs: Sequence[str | Path], out: str | Path, patterns: Sequence[str] = (),
                 targets: dict[str, float] | None = None) -> dict[str, Any]:
    """Loads the runs, writes OUT/report.md, OUT/summary.json and OUT/curves_<axis>.png; returns the summary."""
    if not run_dirs:
        raise UserError("pass at least one run directory")
    if missing := [str(p) for p in run_dirs if not Path(p).is_dir()]:
        raise UserError(f"run directory {missing[0]} does not exist")
    resolved = [Path(p).resolve() for p in run_dirs]
    for i, p in enumerate(run_dirs):  # the same run twice would pass for a two-seed group with zero spread
        if (first := resolved.index(resolved[i])) < i:
            raise UserError(f"run {p} is given twice (also as {run_dirs[first]}); pass each run once")
    runs = [load_run(p) for p in run_dirs]
    known = sorted({m for run in runs for m in run.series})
    if unknown := sorted(set(targets or {}) - set(known)):
        raise UserError(f"--target {unknown[0]}: no run has that metric; the runs have {', '.join(known)}")
    groups = group_runs(runs, patterns)
    summary = summarize(groups, targets)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown_report(groups, summary))
    (out / "summary.json").write_text(json.dumps({
        m: {"target": info["target"], "lower_is_better": info["lower_is_better"],
            "rows": [{"group": r.group, "final_step": r.final_step, **row_summary(r)} for r in info["rows"]]}
        for m, info in summary.items()}, indent=1))
    write_curves(groups, list(summary), out, f"mean over the runs of a group, band = {LEVEL:.0%} t interval of the mean")
    return summary
