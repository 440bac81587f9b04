"""A study's report: `<out>/report/` report.md, summary.json, curves_<axis>.png. Every run is listed;
the paired statistics use finished runs only (a run stopped half way would pass for a slow one)."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ..errors import UserError
from ..evaluation.metric_registry import is_heldout_part, lower_is_better as is_lower_better
from ..evaluation.stats import MeanInterval
from ..files import write_atomic
from .comparison import LEVEL, MetricRow, PairedSpeedup, metric_rows, row_summary, step_intervals, write_curves
from .costs import arm_flops_per_step
from .run_curves import Group, Run, load_run
from .spec import Study
from .status import RunStatus


def _interval(mi: MeanInterval | None, signed: bool = False) -> str:
    if mi is None:
        return "-"
    fmt = "{:+.4g}" if signed else "{:.4g}"
    spread = "(1 seed)" if mi.low is None else f"[{fmt.format(mi.low)}, {fmt.format(mi.high)}]"
    return f"{fmt.format(mi.mean)} {spread}"


def _per_seed(result: PairedSpeedup | None) -> str:
    if result is None:
        return "-"
    return "; ".join(f"s{s.seed}: {s.arm_steps if s.arm_steps is not None else f'> {s.arm_final_step}'} "
                     f"(baseline {s.baseline_steps})" for s in result.seeds)


def _speedup(result: PairedSpeedup | None) -> str:
    if result is None:
        return "-"
    n, missed = len(result.seeds), len(result.seeds) - result.reached
    if missed:
        bounds = ", ".join(f"s{s.seed} < {s.bound:.3g}x" for s in result.seeds if s.bound is not None)
        return f"not reached by {missed} of {n} seeds ({bounds})"
    if result.low is None:
        return f"{result.geomean:.3g}x ({n} seed)"
    return f"{result.geomean:.3g}x [{result.low:.3g}, {result.high:.3g}]"


def _shown(path) -> str:
    """Relative to the current folder when below it: the report reads the same on every checkout."""
    resolved, here = Path(path).resolve(), Path.cwd().resolve()
    return str(resolved.relative_to(here) if resolved.is_relative_to(here) else path)


def _cell(text: str | None) -> str:
    """Text that stays inside one Markdown table cell."""
    return (text or "no message").replace("|", "\\|").replace("\n", " ")


class StudyReport:
    """A study's finished runs, grouped by arm, with each arm's FLOPs per step."""

    def __init__(self, study: Study, statuses: Sequence[RunStatus], batch_sizes: dict[str, int]):
        self.study, self.statuses = study, list(statuses)
        self.unreadable: dict[str, str] = {}
        runs: dict[str, list[Run]] = {arm: [] for arm in study.arms}
        for status in self.statuses:
            if status.state == "done":
                try:
                    runs[status.job.arm].append(load_run(status.job.run_dir))
                except UserError as err:
                    self.unreadable[status.job.name] = str(err)
        self.flops = arm_flops_per_step(study.out, {arm: ([r.path for r in members], batch_sizes[arm])
                                                    for arm, members in runs.items()})
        for arm, members in runs.items():
            for run in members:
                run.flops_per_step = self.flops[arm]
        self.groups = {arm: Group(arm, members) for arm, members in runs.items() if members}
        self.metrics = sorted({m for g in self.groups.values() for r in g.runs for m in r.series},  # losses first
                              key=lambda m: ({"heldout_loss": 0, "train_loss": 1}.get(m, 2), m))

    def metric_rows(self, metric: str) -> list[MetricRow]:
        return metric_rows(list(self.groups.values()), metric, self.study.baseline_of)


def _how_to_read(study: Study) -> list[str]:
    return [
        "## How to read this report", "",
        f"- **Intervals** are {LEVEL:.0%} Student-t intervals of a mean over seeds: mean ± t(0.975, n-1) · s / √n (s: "
        "standard deviation over the seeds, ddof 1); one seed gives no interval. The bands in the figures are the "
        "same interval at every evaluated step.",
        "- **Paired by seed**: every arm trains with the same seeds, and runs of one seed share their data order and "
        f"noise, so each arm is compared with the baseline ({study.baseline_label}) seed by seed.",
        "- **final - baseline**: the arm's final value minus the baseline's, per seed, then the mean and its t "
        "interval.",
        "- **Steps to the baseline's final value**: for seed s, the target is the baseline's final value for s; "
        "steps_s is the first evaluated step at which the curve reaches it (<= for lower-is-better metrics, >= "
        "otherwise); the baseline's own steps_s is the first step it reaches its final value. `> N`: not reached by "
        "the arm's last step N.",
        "- **Speedup** per seed = baseline steps_s / arm steps_s; reported as the geometric mean over seeds with a t "
        "interval on the log speedups. A seed whose arm never reaches the target is censored (its speedup is below "
        "baseline steps_s / the arm's last step); then no interval is given.",
        "- **Verdict**: *faster by Gx [lo, hi]* when the whole interval lies above 1; *slower by ...* when it lies "
        "below 1, or when most seeds never reach the target; otherwise *no difference detected at this budget* (the "
        "interval includes 1, or it could not be computed: a single seed, or some seeds not reaching the target). No "
        "difference detected is not evidence of no difference: more seeds or steps narrow the interval.",
        "- Metrics named digits_* are the digits metric (an SVC's accuracy, Fréchet distance on pixels), NOT FID. "
        "heldout_mse* / heldout_vb* are parts of heldout_loss: tables only.",
        "- **FLOPs** per step: network forward + backward (matrix products, attention included) counted once per "
        "model config on a micro-batch, x global batch size; optimizer, EMA and gradient-checkpointing recomputation "
        "are not included. Training seconds exclude evaluation.", ""]


def _step_table(curves: dict[str, dict[int, tuple]]) -> list[str]:
    if not curves:
        return []
    def cell(point: tuple | None) -> str:
        if point is None:
            return "-"
        mean, low, high = point
        return f"{mean:.4g}" + ("" if low is None else f" [{low:.4g}, {high:.4g}]")

    arms = list(curves)
    lines = ["Per evaluated step, mean [95% t interval] over seeds:", "", "| step | " + " | ".join(arms) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for step in sorted({s for c in curves.values() for s in c}):
        lines.append(f"| {step} | " + " | ".join(cell(curves[arm].get(step)) for arm in arms) + " |")
    return lines + [""]


def markdown(report: StudyReport, tables: dict[str, tuple[list[MetricRow], dict]], figures: Sequence[str]) -> str:
    study = report.study
    states = [s.state for s in report.statuses]
    lines = [f"# Study: {study.name}", ""]
    if study.description:
        lines += [study.description.strip(), ""]
    lines += [f"Study file `{_shown(study.source)}`; base config `{_shown(study.base)}`; common overrides "
              f"`{json.dumps(study.overrides)}`; {len(study.arms)} arms x {len(study.seeds)} seeds "
              f"({', '.join(map(str, study.seeds))}) = {len(states)} runs; baseline **{study.baseline_label}**. "
              f"Written {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.", "",
              "## Runs", "", "| run | arm | seed | state | step | held-out loss |", "|---|---|---|---|---|---|"]
    for s in report.statuses:
        note = f" (exit {s.exit_code}: {_cell(s.error)})" if s.state == "failed" else ""
        note += f" (logs unreadable: {_cell(report.unreadable[s.job.name])})" if s.job.name in report.unreadable else ""
        loss = "-" if s.heldout_loss is None else f"{s.heldout_loss:.4g}"
        lines.append(f"| {s.job.name} | {s.job.arm} | {s.job.seed} | {s.state}{note} | {s.step}/{s.max_steps} | {loss} |")
    unfinished = [s.job.name for s in report.statuses if s.state != "done"]
    lines += ["", f"Statistics below use the finished runs only ({states.count('done')} of {len(states)})"
              + (f"; not used: {', '.join(unfinished)}." if unfinished else "."), ""]
    lines += ["## Arms", "", "| arm | overrides | FLOPs / step |", "|---|---|---|"]
    for arm, values in study.arms.items():
        flops = report.flops.get(arm)
        lines.append(f"| {arm} | `{json.dumps(values)}` | {'-' if flops is None else f'{flops:.4g}'} |")
    lines.append("")
    if isinstance(study.baseline, str) and study.baseline not in report.groups:
        lines += [f"The baseline arm {study.baseline} has no finished run yet: no paired statistics.", ""]
    lines += ["## Verdicts", "", f"Speedup to the baseline's final value, paired by seed ({LEVEL:.0%} t interval).", ""]
    sections = []
    for metric, (rows, steps) in tables.items():
        arrow = "lower is better" if is_lower_better(metric) else "higher is better"
        if not is_heldout_part(metric):
            lines += [f"- **{metric}**, {r.group}: {r.verdict}" for r in rows if r.verdict != "baseline"]
        sections += [f"## {metric} ({arrow})", "",
                   "| arm | seeds | final value [95% t] | final - baseline, paired [95% t] | steps to the baseline's "
                   "final value, per seed | speedup [95% t] | verdict |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            sections.append(f"| {r.group} | {r.seeds} | {_interval(r.final)} | {_interval(r.difference, True)} | "
                            f"{_per_seed(r.speedup)} | {_speedup(r.speedup)} | {r.verdict} |")
        sections.append("")
        if metric != "train_loss" and not is_heldout_part(metric):
            sections += _step_table(steps)
    if not report.metrics:
        lines.append("- no finished run yet")
    lines += [""] + sections
    if figures:
        lines += ["## Curves", ""] + [f"![{name}]({name})" for name in figures] + [""]
    return "\n".join(lines + _how_to_read(study)) + "\n"


def _summary(report: StudyReport, tables: dict[str, tuple[list[MetricRow], dict]]) -> dict[str, Any]:
    metrics = {metric: {"lower_is_better": is_lower_better(metric), "arms": {r.group: row_summary(r) for r in rows}}
               for metric, (rows, _) in tables.items()}
    curves = {metric: {arm: {"step": list(points), "mean": [p[0] for p in points.values()],
                             "low": [p[1] for p in points.values()], "high": [p[2] for p in points.values()]}
                       for arm, points in steps.items()} for metric, (_, steps) in tables.items()}
    return {"study": report.study.name, "baseline": report.study.baseline, "level": LEVEL, "curves": curves,
            "runs": [{"run": s.job.name, "arm": s.job.arm, "seed": s.job.seed, "state": s.state, "step": s.step,
                      "max_steps": s.max_steps, "exit_code": s.exit_code, "error": s.error} for s in report.statuses],
            "flops_per_step": report.flops, "metrics": metrics}


def write_study_report(study: Study, statuses: Sequence[RunStatus], batch_sizes: dict[str, int]) -> Path:
    """Writes `<out>/report/`; returns report.md's path."""
    report = StudyReport(study, statuses, batch_sizes)
    groups = list(report.groups.values())
    folder = study.report_dir
    folder.mkdir(parents=True, exist_ok=True)
    figures = write_curves(groups, report.metrics, folder,
                           f"{study.name}: mean over seeds, band = {LEVEL:.0%} t interval of the mean")
    # metric -> (its rows, its per-step intervals): computed once for the Markdown and the JSON
    tables = {metric: (report.metric_rows(metric), step_intervals(groups, metric)) for metric in report.metrics}
    write_atomic(folder / "summary.json", json.dumps(_summary(report, tables), indent=1).encode())
    write_atomic(folder / "report.md", markdown(report, tables, figures).encode())
    return folder / "report.md"
