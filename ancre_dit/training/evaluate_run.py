"""`evaluate.py --run RUN_DIR`: the in-training evaluation applied to every checkpoint of a run.

Entries go to the run's logs/evals.jsonl like the ones training writes (source "evaluate.py"), with
the same settings (the run's config.yaml `eval` section, plus `eval.*` overrides), so the numbers
of a checkpoint match the ones training wrote at that step. A checkpoint that already has an entry
with these settings is skipped, so an interrupted evaluation resumes where it stopped.
Runs on one process or many (`torchrun ... evaluate.py --run`), sharded as in training.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import UserError
from . import checkpointing as ckpt
from .config import Config, load_config

CONFIG_FILE = "config.yaml"


def run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The run's resolved config with `eval.*` overrides (other sections describe the finished run)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a training run ({CONFIG_FILE} missing); pass the run_dir a training wrote")
    bad = [o for o in overrides if not o.strip().startswith("eval.")]
    if bad:
        raise UserError(f"evaluate.py --run takes eval.* overrides only, got {bad[0]!r} (e.g. eval.num_samples=5000)")
    return load_config(path, list(overrides))


def _select(found: list[tuple[int, Path]], steps: Sequence[int] | None, run_dir: Path) -> list[tuple[int, Path]]:
    if not found:
        raise UserError(f"{run_dir} has no complete checkpoint in {ckpt.checkpoints_dir(run_dir)}; train first")
    if steps is None:
        return found
    have = dict(found)
    missing = [s for s in steps if s not in have]
    if missing:
        raise UserError(f"no checkpoint for step(s) {', '.join(map(str, missing))} in {run_dir}; available: "
                        f"{', '.join(str(s) for s, _ in found)}")
    return [(s, have[s]) for s in sorted(set(steps))]


def evaluate_run(run_dir: str | Path, steps: Sequence[int] | None = None, overrides: Sequence[str] = (),
                 cpu: bool = False, log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """Evaluates the run's checkpoints (all, or `steps`) not yet in evals.jsonl; returns the new entries
    (on the main process). Collective when launched on several processes."""
    from ..sampling.job import SingleProcess

    run_dir = Path(run_dir)
    config = run_config(run_dir, overrides)
    todo_all = _select(ckpt.list_checkpoints(run_dir), steps, run_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _evaluate(run_dir, config, todo_all, SingleProcess(cpu), log)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    try:
        return _evaluate(run_dir, config, todo_all, state, log)
    finally:  # a process group left open aborts the process at exit
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _evaluate(run_dir: Path, config: Config, selected: list[tuple[int, Path]], state, log) -> list[dict[str, Any]]:
    from ..diffusion import build_objective
    from ..evaluation.evaluator import Evaluator, append_eval, evaluated_steps, format_eval, read_evals
    from ..evaluation.heldout import build_heldout_set
    from ..sampling.decode import build_decoder
    from ..checkpoint import load_model_spec, load_trained_model
    from .data import build_data
    from .periodic import QUALITY_PLOT, plot_quality

    log = log if state.is_main_process else (lambda *a, **k: None)
    spec = load_model_spec(selected[-1][1])
    e, d = config.eval, build_data(config, int(config.model.name.rsplit("/", 1)[1]))
    objective = build_objective(spec["diffusion"])  # old specs (no objective) build DDPM
    heldout = None
    if e.heldout_loss and d.heldout is not None:
        heldout = build_heldout_set(d.heldout, d.kind, max_examples=e.heldout_max, draws=e.heldout_draws, seed=e.seed,
                                    objective=objective)
    decoder = build_decoder(spec["data"], d.in_channels, config.data.vae, state.device)
    evaluator = Evaluator(e, data_kind=d.kind, num_classes=d.num_classes, objective=objective,
                          heldout=heldout, decoder=decoder, state=state, log=log)
    done = evaluated_steps(run_dir, evaluator.identity)
    todo = [(s, p) for s, p in selected if s not in done]
    log(f"evaluating {len(todo)} checkpoint(s) of {run_dir} ({len(selected) - len(todo)} already in evals.jsonl)")
    new = []
    for step, folder in todo:
        ema, _ = load_trained_model(folder, "ema", state.device)
        raw, _ = load_trained_model(folder, "model", state.device)
        result = evaluator.evaluate(ema, raw_model=raw)
        state.wait_for_everyone()
        if result is None:
            continue
        trainer_state = ckpt.read_trainer_state(folder)
        entry = {"step": step, "images_seen": step * int(trainer_state.get("global_batch_size", config.train.global_batch_size)),
                 "train_seconds": trainer_state.get("train_seconds"), "source": "evaluate.py", **result,
                 "settings": evaluator.identity}
        append_eval(run_dir, entry)
        log(format_eval(entry))
        new.append(entry)
    if state.is_main_process and new:
        plot_quality([x for x in read_evals(run_dir) if x.get("settings") == evaluator.identity], run_dir / QUALITY_PLOT)
    state.wait_for_everyone()
    return new
