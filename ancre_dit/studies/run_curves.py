"""The curves training runs logged (config.yaml, logs/metrics.jsonl, logs/evals.jsonl), loaded and
grouped (a group: the seeds of one setting). Metrics: `train_loss` and every key of the evals' "metrics"."""
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
from ..training.run_evaluation import read_evals

AXES = {"step": "step", "images": "images seen", "seconds": "training seconds (evaluation excluded)",
        "flops": "training FLOPs (forward + backward)"}  # step x FLOPs per step, where a run knows it


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
        seed = (self.config.get("train") or {}).get("seed")
        return None if seed is None else int(seed)

    def axis_values(self, series: Series, rows: np.ndarray, axis: str) -> np.ndarray:
        """x values of `series` at `rows` on an axis of AXES (NaN where unknown)."""
        if axis not in ("step", "flops"):
            return getattr(series, axis)[rows]
        steps = series.step[rows].astype(np.float64)
        return steps if axis == "step" else steps * (np.nan if self.flops_per_step is None else self.flops_per_step)


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

    by_metric = {"train_loss": {int(r["step"]): point(r, r["loss"])
                                for r in read_jsonl(path / "logs" / "metrics.jsonl") if "loss" in r}}
    evals = read_evals(path)
    for row in evals:  # one evaluation setting per run: the latest one's (a re-evaluation with new settings wins)
        if row.get("settings") == evals[-1].get("settings"):
            for k, v in row["metrics"].items():
                by_metric.setdefault(k, {})[int(row["step"])] = point(row, v)
    run.series.update({k: _series(v) for k, v in by_metric.items() if v})
    if not run.series:
        present = [p.relative_to(path) for p in (path / "logs" / "metrics.jsonl", path / "logs" / "evals.jsonl")
                   if p.is_file()]
        if present:  # there, but without a record (a run stopped before its first log step)
            raise UserError(f"{path}: {' and '.join(map(str, present))} hold no records yet (the run logged no step); "
                            "let it train past train.log_every, or leave that run out")
        raise UserError(f"{path} holds no logs/metrics.jsonl or logs/evals.jsonl; pass run directories written by train.py")
    return run


@dataclass
class Group:
    label: str
    runs: list[Run]

    def aligned(self, metric: str, axis: str = "step") -> tuple[np.ndarray, np.ndarray] | None:
        """(x: the members' mean on the axis, NaN where one lacks it; values (runs, points)) over the steps every
        member has; None when a member lacks the metric."""
        members = [r.series.get(metric) for r in self.runs]
        if any(s is None for s in members):
            return None
        steps = sorted(set.intersection(*(set(s.step.tolist()) for s in members)))
        if not steps:
            return None
        rows = [np.searchsorted(s.step, steps) for s in members]
        x = np.stack([r.axis_values(s, i, axis) for r, s, i in zip(self.runs, members, rows)]).mean(axis=0)
        return x, np.stack([s.value[i] for s, i in zip(members, rows)])


def group_runs(runs: Sequence[Run], patterns: Sequence[str] = ()) -> list[Group]:
    """Groups in the order of their first run: runs whose name matches one of `patterns` (fnmatch), or
    without patterns, runs whose configs agree but for run_dir and train.seed."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if patterns:
            key = next((p for p in patterns if fnmatch.fnmatch(run.name, p)), f"run:{run.path}")
        else:
            config = json.loads(json.dumps(run.config))  # a deep copy
            config.pop("run_dir", None)
            (config.get("train") or {}).pop("seed", None)
            key = json.dumps(config, sort_keys=True)
        groups.setdefault(key, []).append(run)
    out = []
    for key, members in groups.items():
        if len(members) == 1:
            label = members[0].name
        elif patterns and not key.startswith("run:"):
            label = key
        else:
            prefix = os.path.commonprefix([r.name for r in members]).rstrip("-_ ")
            label = f"{prefix}* ({len(members)} runs)" if prefix else f"{members[0].name} +{len(members) - 1}"
        out.append(Group(label, members))
    return out
