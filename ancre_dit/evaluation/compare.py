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

Seed-paired statistics (studies: every arm trained with the same seeds, and runs of one seed share
their data order and noise): the mean over seeds with a Student-t interval at every step
(`interval_curve`), the final-value difference to a baseline paired by seed (`paired_difference`),
the per-seed steps to the baseline's final value and their speedup, summarised as a geometric mean
with a t interval on log speedups (`paired_speedup`), and a verdict line that reads them (`verdict`).
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from ..errors import UserError
from ..files import read_jsonl
from .evaluator import is_heldout_part, is_lower_better, read_evals
from .stats import MeanInterval, mean_t_interval

AXES = {"step": "step", "images": "images seen", "seconds": "training seconds (evaluation excluded)"}
# Training compute: step x FLOPs of one training step (network forward + backward, counted once per
# config; see ancre_dit.models.flops). Only runs that know their FLOPs per step have this axis.
FLOPS_AXIS = {"flops": "training FLOPs (forward + backward)"}


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
    flops_per_step: float | None = None  # set by callers that counted it (studies); enables the "flops" axis

    @property
    def seed(self) -> int | None:
        """train.seed from the run's config.yaml (None when it does not say)."""
        seed = (self.config.get("train") or {}).get("seed")
        return None if seed is None else int(seed)

    def axis_values(self, series: Series, rows: np.ndarray, axis: str) -> np.ndarray:
        """x values of `series` at `rows` on an axis of AXES or FLOPS_AXIS (NaN where unknown)."""
        if axis == "step":
            return series.step[rows].astype(np.float64)
        if axis == "flops":
            per_step = np.nan if self.flops_per_step is None else float(self.flops_per_step)
            return series.step[rows].astype(np.float64) * per_step
        return getattr(series, axis)[rows]


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

    def aligned(self, metric: str, axis: str = "step") -> tuple[np.ndarray, np.ndarray] | None:
        """(x, values of shape (runs, points)) over the steps every member has; None when a member
        lacks the metric. x is the members' mean on the axis: NaN where any member lacks it (e.g.
        runs from before train_seconds was logged)."""
        members = [r.series.get(metric) for r in self.runs]
        if any(s is None for s in members):
            return None
        steps = sorted(set.intersection(*(set(s.step.tolist()) for s in members)))
        if not steps:
            return None
        rows = [np.searchsorted(s.step, steps) for s in members]
        values = np.stack([s.value[i] for s, i in zip(members, rows)])
        x = np.stack([r.axis_values(s, i, axis) for r, s, i in zip(self.runs, members, rows)]).mean(axis=0)
        return x, values

    def curve(self, metric: str, axis: str = "step") -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """(x, mean, std or None) over the steps every member has; None when a member lacks the metric."""
        found = self.aligned(metric, axis)
        if found is None:
            return None
        x, values = found
        std = values.std(axis=0, ddof=1) if len(self.runs) > 1 else None
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


# -- seed-paired statistics (studies) --------------------------------------------------------------
def interval_curve(group: Group, metric: str, axis: str = "step", level: float = 0.95
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(x, mean over the group's runs, half width of the Student-t interval of that mean, or None
    for a single run) at every step all members have; None when a member lacks the metric."""
    found = group.aligned(metric, axis)
    if found is None:
        return None
    x, values = found
    if len(group.runs) < 2:
        return x, values[0], None
    columns = [mean_t_interval(values[:, k], level) for k in range(values.shape[1])]
    return x, np.array([c.mean for c in columns]), np.array([c.high - c.mean for c in columns])


def final_value(run: Run, metric: str) -> tuple[int, float] | None:
    """(last step, value there) of a run's metric; None when the run lacks it."""
    series = run.series.get(metric)
    if series is None or not len(series.step):
        return None
    return int(series.step[-1]), float(series.value[-1])


@dataclass
class SeedSpeedup:
    """One seed of a paired comparison: the target (the baseline's final value for this seed), the
    first evaluated step at which the baseline and the arm reach it, and their ratio. When the arm
    never reaches it (arm_steps None) the speedup is censored: below `bound` = baseline steps / the
    arm's last step (it would have reached the target after its last step at the earliest)."""
    seed: int
    target: float
    baseline_steps: int
    arm_steps: int | None
    arm_final_step: int
    speedup: float | None
    bound: float | None


@dataclass
class PairedSpeedup:
    """Speedups of an arm over the baseline, seed by seed, and their geometric mean with a t
    interval on the log speedups (None unless every seed reached the target and there are >= 2)."""
    metric: str
    lower_is_better: bool
    seeds: list[SeedSpeedup]
    geomean: float | None
    low: float | None
    high: float | None
    level: float

    @property
    def reached(self) -> int:
        return sum(s.arm_steps is not None for s in self.seeds)


def _by_seed(runs: Sequence[Run]) -> dict[int, Run]:
    out: dict[int, Run] = {}
    for run in runs:
        if run.seed is None:
            raise UserError(f"{run.path}/config.yaml gives no train.seed; seed-paired statistics need it")
        if run.seed in out:
            raise UserError(f"runs {out[run.seed].path} and {run.path} share train.seed={run.seed}; a seed-paired "
                            f"comparison needs one run per seed")
        out[run.seed] = run
    return out


def paired_speedup(baseline: Sequence[Run], arm: Sequence[Run], metric: str, level: float = 0.95) -> PairedSpeedup | None:
    """Steps to the baseline's final value, paired by seed (runs of one seed share data order and
    noise): for each seed s both sides have, target_s = the baseline's final value, steps_s = the
    first evaluated step at which a run's curve reaches target_s (<= when lower is better, >=
    otherwise; the baseline reaches its own final value at its last step at the latest), and the
    speedup = baseline steps_s / arm steps_s. None when no seed has the metric on both sides."""
    lower = is_lower_better(metric)
    base_runs, arm_runs = _by_seed(baseline), _by_seed(arm)
    seeds: list[SeedSpeedup] = []
    for seed in sorted(set(base_runs) & set(arm_runs)):
        base, other = base_runs[seed].series.get(metric), arm_runs[seed].series.get(metric)
        if base is None or other is None or not len(base.step) or not len(other.step):
            continue
        target = float(base.value[-1])
        base_steps = steps_to_target(base.step, base.value, target, lower)
        arm_steps = steps_to_target(other.step, other.value, target, lower)
        final = int(other.step[-1])
        seeds.append(SeedSpeedup(seed, target, base_steps, arm_steps, final,
                                 None if arm_steps is None else base_steps / arm_steps,
                                 base_steps / final if arm_steps is None else None))
    if not seeds:
        return None
    geomean = low = high = None
    if all(s.speedup is not None for s in seeds):
        logs = mean_t_interval([math.log(s.speedup) for s in seeds], level)
        geomean = math.exp(logs.mean)
        if logs.low is not None:
            low, high = math.exp(logs.low), math.exp(logs.high)
    return PairedSpeedup(metric, lower, seeds, geomean, low, high, level)


def paired_difference(baseline: Sequence[Run], arm: Sequence[Run], metric: str, level: float = 0.95
                      ) -> MeanInterval | None:
    """Final value of the arm minus the baseline's, seed by seed, with the t interval of its mean
    (None when no seed has the metric on both sides)."""
    base_runs, arm_runs = _by_seed(baseline), _by_seed(arm)
    diffs = []
    for seed in sorted(set(base_runs) & set(arm_runs)):
        a, b = final_value(arm_runs[seed], metric), final_value(base_runs[seed], metric)
        if a is not None and b is not None:
            diffs.append(a[1] - b[1])
    return mean_t_interval(diffs, level) if diffs else None


def _x(v: float) -> str:
    return f"{v:.3g}x"


def verdict(result: PairedSpeedup) -> str:
    """One line: "faster by Gx [lo, hi]" when the interval of the geometric-mean speedup lies above
    1, "slower by ..." when it lies below 1 (or when most seeds never reach the target), else "no
    difference detected at this budget" (with the reason an interval is missing, if it is)."""
    n, missed = len(result.seeds), len(result.seeds) - result.reached
    if missed * 2 > n:
        return f"slower: the baseline's final value not reached by {missed} of {n} seeds"
    if missed:
        return f"no difference detected at this budget (not reached by {missed} of {n} seeds: no interval)"
    if result.low is None:
        return f"no difference detected at this budget ({n} seed: no interval; speedup {_x(result.geomean)})"
    span = f"[{result.low:.3g}, {result.high:.3g}]"
    if result.low > 1:
        return f"faster by {_x(result.geomean)} {span}"
    if result.high < 1:
        return f"slower by {_x(1 / result.geomean)} [{1 / result.high:.3g}, {1 / result.low:.3g}]"
    return f"no difference detected at this budget (speedup {_x(result.geomean)} {span})"


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
            if is_heldout_part(metric):  # table only
                continue
            curves = {g.label: c for g in groups if (c := g.curve(metric, axis)) is not None and np.isfinite(c[0]).all()}
            if curves:
                panels[metric] = curves
        if panels:
            plot_panels(panels, out / f"curves_{axis}.png", xlabel=label)
    return summary
