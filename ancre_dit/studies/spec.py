"""A study file (docs/studies.md): base config, common overrides, arms and/or a grid, seeds, baseline -> runs.

Grid arms are named from their values in key order, joined by "-": a text value as itself, any other as
the key's last part then the value ({model.topology: ancre, model.tau: 0.01} is `ancre-tau0.01`); other
characters than letters, digits and `._+-` become `_`. Run `<arm>-s<seed>` trains in `<out>/runs/<arm>-s<seed>`
with `train.seed=<seed>`. Every config is loaded before anything is written: a mistake costs no run.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError

KEYS = ("name", "description", "out", "base", "overrides", "arms", "grid", "seeds", "baseline", "slurm")
SLURM_KEYS = ("partition", "account", "gpus_per_node", "nodes", "time_min", "array_parallelism", "cpus_per_task")
RESERVED = ("train.seed", "run_dir")  # the study sets these per run


@dataclass(frozen=True)
class Job:
    """One run of the study: an arm trained with one seed."""
    arm: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]  # every `key=value` after the base config, run_dir last

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class Study:
    source: Path
    name: str
    description: str
    out: Path
    base: Path
    overrides: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    seeds: list[int]
    # An arm's name, or overrides ({model.topology: cascaded}): each arm against the arm that sets these
    # and agrees with it on everything else that arm sets (a depth sweep: each depth against its own DiT).
    baseline: str | dict[str, Any]
    slurm: dict[str, Any] = field(default_factory=dict)

    def baseline_of(self, arm: str) -> str:
        if isinstance(self.baseline, str):
            return self.baseline
        return baseline_candidates(self.arms, self.baseline, arm)[0]

    @property
    def baseline_label(self) -> str:
        if isinstance(self.baseline, str):
            return self.baseline
        return ", ".join(f"{k}={v}" for k, v in self.baseline.items()) + " (each arm against its own)"

    @property
    def runs_dir(self) -> Path:
        return self.out / "runs"

    @property
    def report_dir(self) -> Path:
        return self.out / "report"

    @property
    def jobs(self) -> list[Job]:
        """Seed by seed (every arm's seed 0 first): a study stopped part-way still compares every arm."""
        out = []
        for seed in self.seeds:
            for arm, values in self.arms.items():
                run_dir = self.runs_dir / f"{arm}-s{seed}"
                # An arm's value replaces the common one: each key once on the command line.
                merged = {**self.overrides, **values}
                out.append(Job(arm, seed, run_dir, (*(f"{k}={yaml_value(v)}" for k, v in merged.items()),
                                                    f"train.seed={seed}", f"run_dir={run_dir}")))
        return out

    def record(self) -> dict[str, Any]:
        """What study.json holds: enough to tell this study from another one."""
        return {"name": self.name, "source": str(self.source), "base": str(self.base), "overrides": self.overrides,
                "arms": self.arms, "seeds": self.seeds, "baseline": self.baseline}


def yaml_value(value: Any) -> str:
    """A value as the text of a `key=value` override that reads back as the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def _flatten(mapping: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """{model: {depth: 12}} and {model.depth: 12} alike -> {"model.depth": 12}."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise UserError(f"{where} must be a mapping of config keys to values (e.g. model.depth: 12), got {mapping!r}")
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or not key.strip():
            raise UserError(f"{where}: config key {key!r} must be text such as model.depth")
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, where, f"{full}."))
        else:
            out[full] = value
    if reserved := [key for key in out if key in RESERVED]:
        raise UserError(f"{where} sets {reserved[0]}; the study sets it for every run "
                        "(seeds: and <out>/runs/<arm>-s<seed>)")
    return out


def _token(key: str, value: Any) -> str:
    text = str(value) if isinstance(value, str) else f"{key.split('.')[-1]}{yaml_value(value)}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def grid_arms(grid: Any, where: str) -> dict[str, dict[str, Any]]:
    flat = _flatten(grid, where)
    if not flat:
        return {}
    for key, values in flat.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}: {key} must be a non-empty list of values, got {values!r}")
    arms: dict[str, dict[str, Any]] = {}
    for combo in itertools.product(*flat.values()):
        values = dict(zip(flat, combo))
        name = "-".join(_token(k, v) for k, v in values.items())
        if name in arms:
            raise UserError(f"{where}: two grid points are both named {name!r}; give them distinct values or named arms")
        arms[name] = values
    return arms


def baseline_candidates(arms: dict[str, dict[str, Any]], baseline: dict[str, Any], arm: str) -> list[str]:
    """The arms that set the baseline's values and agree with `arm` on every other key they set."""
    return [name for name, values in arms.items()
            if all(values.get(k) == v for k, v in baseline.items())
            and all(arms[arm].get(k) == v for k, v in values.items() if k not in baseline)]


def load_study(path: str | Path) -> Study:
    """Reads and checks a study file (not the configs: see `validate`)."""
    from ..files import read_yaml_mapping

    path = Path(path)
    raw = read_yaml_mapping(path, "study", "pass a study YAML such as studies/digits-depth.yaml",
                            "base:, arms: and/or grid:, seeds:, baseline:")
    if unknown := sorted(set(raw) - set(KEYS)):
        raise UserError(f"{path}: unknown key {unknown[0]!r}; a study file holds {', '.join(KEYS)}")
    if not raw.get("base"):
        raise UserError(f"{path}: base: is missing; name the config every run starts from, e.g. base: configs/quickstart.yaml")
    base = Path(str(raw["base"]))
    if not base.is_file():
        raise UserError(f"{path}: base config {base} not found (paths are relative to the current folder)")
    arms = {}
    for name, values in (raw.get("arms") or {}).items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
            raise UserError(f"{path}: arm name {name!r} must use letters, digits and ._+- only (it names folders)")
        arms[name] = _flatten(values, f"{path}: arm {name}")
    for name, values in grid_arms(raw.get("grid"), f"{path}: grid").items():
        if name in arms:
            raise UserError(f"{path}: duplicate arm name {name!r} (a named arm and a grid point); rename the arm")
        arms[name] = values
    if not arms:
        raise UserError(f"{path}: no arms; give arms: (named sets of overrides) and/or a non-empty grid:")
    baseline = raw.get("baseline")
    if baseline is None and len(arms) == 1:
        baseline = next(iter(arms))
    if isinstance(baseline, dict):
        baseline = _flatten(baseline, f"{path}: baseline")
        for name in arms:
            found = baseline_candidates(arms, baseline, name)
            if len(found) != 1:
                wanted = ", ".join(f"{k}={v}" for k, v in baseline.items())
                raise UserError(f"{path}: arm {name} has {'no' if not found else 'more than one'} baseline arm (one "
                                f"with {wanted} agreeing with it on its other overrides{': ' + ', '.join(found) if found else ''})"
                                f"; {'add' if not found else 'keep'} one")
    elif baseline not in arms:
        raise UserError(f"{path}: baseline {baseline!r} is not among the arms ({', '.join(arms)}); name one of them, "
                        f"or give overrides such as {{model.topology: cascaded}} to compare each arm with its own")
    overrides, seeds = _flatten(raw.get("overrides"), f"{path}: overrides"), raw.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        raise UserError(f"{path}: seeds must be a non-empty list of integers, e.g. seeds: [0, 1, 2]; got {seeds!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise UserError(f"{path}: seeds must be integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"{path}: seeds {seeds} repeat a seed; give each once")
    slurm = {} if raw.get("slurm") is None else raw["slurm"]
    if not isinstance(slurm, dict) or set(slurm) - set(SLURM_KEYS):
        unknown = sorted(set(slurm) - set(SLURM_KEYS)) if isinstance(slurm, dict) else slurm
        raise UserError(f"{path}: slurm must be a mapping of {', '.join(SLURM_KEYS)}; unknown: {unknown}")
    out = Path(str(raw.get("out") or Path("results") / "studies" / path.stem))
    return Study(source=path, name=str(raw.get("name") or path.stem), description=str(raw.get("description") or ""),
                 out=out.absolute(), base=base.absolute(), overrides=overrides, arms=arms, seeds=list(seeds),
                 baseline=baseline if isinstance(baseline, dict) else str(baseline), slurm=dict(slurm))


def job_config(study: Study, job: Job, check_paths: bool = True):
    """The job's training Config; a UserError names the arm. Without `check_paths`, paths need not exist."""
    from ..training.config import load_config

    try:
        return load_config(study.base, job.overrides, check_paths)
    except UserError as err:
        raise UserError(f"{study.source}: arm {job.arm} (seed {job.seed}): {err}") from None


def validate(study: Study, check_paths: bool = True) -> dict[str, Any]:
    """{run name: Config} of every run; the first problem is one UserError."""
    return {job.name: job_config(study, job, check_paths) for job in study.jobs}
