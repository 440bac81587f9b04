"""Evaluating a training run: one builder and one record for both the in-training evaluation
(periodic.EvaluationTask) and `evaluate.py --run RUN_DIR`, on one process or many. Entries go to
RUN/logs/evals.jsonl (source "train" or "evaluate.py") with the run's `eval` settings (plus evaluate.py's
`eval.*` overrides); a checkpoint with an entry of these settings is skipped, so an interrupted
evaluation resumes where it stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UserError
from ..files import append_jsonl, read_jsonl
from ..hardware import configure_precision
from . import checkpointing as ckpt
from .config import Config, load_config
from .rank_decisions import main_decides

CONFIG_FILE = "config.yaml"


def build_run_evaluator(config: Config, data, objective, decoder, state):
    """The Evaluator of a run's `eval` settings: fixed held-out examples (when the data has a held-out
    split and eval.heldout_loss) and the sample metrics, whose images `decoder` makes."""
    from ..evaluation.evaluator import Evaluator, build_heldout_set

    e = config.eval
    heldout = None
    if e.heldout_loss and data.heldout is not None:
        heldout = build_heldout_set(data.heldout, data.kind, max_examples=e.heldout_max, draws=e.heldout_draws,
                                    seed=e.seed, objective=objective, latent_norm=data.latent_norm)
    guide = None
    if e.guide_ckpt:
        from ..sampling.job import load_guide
        spec = {"data": ckpt.data_spec(data), "diffusion": objective.spec()}
        guide = load_guide(e.guide_ckpt, spec, state.device, f"eval.guide_ckpt {e.guide_ckpt}", "this run")
    evaluator = Evaluator(e, data_kind=data.kind, num_classes=data.num_classes, objective=objective, heldout=heldout,
                          decoder=decoder, state=state, guide=guide)
    # The reference's features now, on the main process, while the others wait with nothing queued;
    # a bad reference stops every process here.
    main_decides(state, evaluator.prepare_reference)
    return evaluator


def evaluate_emas(evaluator, emas: dict[str, Any], raw_model, should_stop=None) -> dict[str, Any] | None:
    """Every EMA eval.emas names in one result: `ema`'s metrics as they are, another's as <metric>@<name>
    (the raw model's held-out loss once, with the first)."""
    merged = None
    for k, name in enumerate(evaluator.settings.emas):
        result = evaluator.evaluate(emas[name], raw_model=raw_model if k == 0 else None, should_stop=should_stop)
        if result is None:  # not the main process
            continue
        metrics = {(key if name == "ema" else f"{key}@{name}"): v for key, v in result["metrics"].items()}
        if merged is None:
            merged = {**result, "metrics": metrics}
        else:
            merged["metrics"].update(metrics)
            merged["seconds"] = round(merged["seconds"] + result["seconds"], 3)
    return merged


def record_evaluation(run_dir: Path, result: dict[str, Any], identity: dict[str, Any], *, step: int,
                      images_seen: int, train_seconds: float | None, source: str, log: Callable[[str], Any],
                      tracker=None) -> dict[str, Any]:
    """Appends one evaluation to RUN/logs/evals.jsonl, logs it, sends its metrics to `tracker` (an
    Accelerator) when given; returns the entry."""
    entry = {"step": step, "images_seen": images_seen, "train_seconds": train_seconds, "source": source, **result,
             "settings": identity}
    append_jsonl(evals_path(run_dir), entry)
    log(format_eval(entry))
    if tracker is not None:
        tracker.log({f"eval/{k}": v for k, v in entry["metrics"].items()}, step=step)
    return entry


def plot_run_quality(run_dir: Path, identity: dict[str, Any]) -> Path | None:
    """RUN/quality.png: held-out loss and every sample metric against step, one panel each, for the
    entries with these settings (the loss's parts stay in evals.jsonl)."""
    from ..evaluation.metric_registry import is_heldout_part
    from ..figures import plot_panels

    series: dict[str, dict[str, tuple[list, list]]] = {}  # metric -> EMA -> (steps, values)
    entries = [e for e in read_evals(run_dir) if e.get("settings") == identity]
    for e in sorted(entries, key=lambda e: e["step"]):
        for k, v in e["metrics"].items():
            metric, _, ema = k.partition("@")
            if is_heldout_part(metric):
                continue
            label = ema or ("raw weights" if metric.endswith("_raw") else "ema")
            steps, values = series.setdefault(metric, {}).setdefault(label, ([], []))
            steps.append(e["step"])
            values.append(v)
    if not series:
        return None
    several = any(len(lines) > 1 or next(iter(lines)) not in ("ema", "raw weights") for lines in series.values())
    panels = {k: {(name if several else ""): (np.asarray(steps), np.asarray(values), None)
                  for name, (steps, values) in lines.items()} for k, lines in series.items()}
    return plot_panels(panels, Path(run_dir) / "quality.png", xlabel="step",
                       title="evaluation (digits_*: digits metric, not FID)")


def evaluate_run(run_dir: str | Path, steps: Sequence[int] | None = None, overrides: Sequence[str] = (),
                 cpu: bool = False, log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """Evaluates the run's checkpoints (all, or `steps`) not yet in evals.jsonl with the run's config
    and `eval.*` overrides; returns the new entries (on the main process). Collective."""
    from ..checkpoint import load_trained_model, read_json_checked
    from ..cli import job_processes

    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a training run ({CONFIG_FILE} missing); pass the run_dir a training wrote")
    if bad := [o for o in overrides if not o.strip().startswith("eval.")]:
        raise UserError(f"evaluate.py --run takes eval.* overrides only, got {bad[0]!r} (e.g. eval.num_samples=5000)")
    config = load_config(path, list(overrides))
    selected = found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir} has no complete checkpoint in {ckpt.checkpoints_dir(run_dir)}; train first")
    if steps is not None:
        have = dict(found)
        if missing := [s for s in steps if s not in have]:
            raise UserError(f"no checkpoint for step(s) {', '.join(map(str, missing))} in {run_dir}; available: "
                            f"{', '.join(str(s) for s, _ in found)}")
        selected = [(s, have[s]) for s in sorted(set(steps))]
    with job_processes(cpu, config.train.collective_timeout_s) as state:  # the run's own setting
        log = log if state.is_main_process else (lambda *a, **k: None)
        _, data, objective, decoder = evaluation_inputs(config, selected[-1][1], state)
        evaluator = build_run_evaluator(config, data, objective, decoder, state)
        done = agree_on_evaluated(state, run_dir, evaluator.identity)
        todo = [(s, p) for s, p in selected if s not in done]
        log(f"evaluating {len(todo)} checkpoint(s) of {run_dir} ({len(selected) - len(todo)} already in "
            f"evals.jsonl)")
        new = []
        for step, folder in todo:
            emas = {name: load_trained_model(folder, name, state.device)[0] for name in config.eval.emas}
            raw, _ = load_trained_model(folder, "model", state.device)
            result = evaluate_emas(evaluator, emas, raw)
            state.wait_for_everyone()
            if result is None:
                continue
            trainer_state = read_json_checked(folder / ckpt.STATE_FILE)
            batch = int(trainer_state.get("global_batch_size", config.train.global_batch_size))
            new.append(record_evaluation(run_dir, result, evaluator.identity, step=step, images_seen=step * batch,
                                         train_seconds=trainer_state.get("train_seconds"), source="evaluate.py",
                                         log=log))
        if state.is_main_process and new:
            plot_run_quality(run_dir, evaluator.identity)
        state.wait_for_everyone()
        return new


def evaluation_inputs(config: Config, folder: Path, state) -> tuple[dict[str, Any], Any, Any, Any]:
    """What evaluating a run's checkpoint after training needs, set up as its training evaluated:
    (the checkpoint's spec, the run's data, the objective, the decoder), with the run's precision."""
    from ..checkpoint import load_model_spec
    from ..diffusion import build_objective
    from ..sampling.api import build_decoder
    from .data import build_data

    configure_precision(state.device, config.train.tf32)  # as the run's in-training evaluations computed
    spec = load_model_spec(folder)
    data = build_data(config)
    decoder = build_decoder(spec["data"], data.in_channels, config.data.vae, state.device)
    return spec, data, build_objective(spec["diffusion"]), decoder


def evals_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs" / "evals.jsonl"


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """Entries of RUN/logs/evals.jsonl in file order (a torn line, from a kill, is skipped and reported)."""
    return read_jsonl(evals_path(run_dir))


def agree_on_evaluated(state: Any, run_dir: str | Path, identity: dict[str, Any]) -> set[int]:
    """The steps evals.jsonl already holds for these settings, read by the main process, shared by all."""
    return main_decides(state, lambda: {int(e["step"]) for e in read_evals(run_dir) if e.get("settings") == identity})


def format_eval(entry: dict[str, Any]) -> str:
    """One log line: 'step 500: heldout_loss 0.1234, digits_acc/cfg2 0.950, ... (3.2 s)'."""
    values = ", ".join(f"{k} {0.0 if v == 0 else v:.4g}" for k, v in entry["metrics"].items())  # no "-0"
    return f"step {entry['step']}: evaluation {values} ({entry['seconds']:.1f} s)"
