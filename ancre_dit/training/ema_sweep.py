"""Sweeping a run's EMA length without retraining: every std of a grid rebuilt from the post-hoc EMA
snapshots (phema.py) at a checkpoint's step, each scored with the run's own evaluation beside the
run's fixed EMA, on two evaluation seeds: one picks the best std, the other scores the pick (a best
chosen and scored on the same samples would flatter it). Across the seeds of a study, the paired
difference of the pick and the fixed EMA, with its interval, says whether post-hoc EMA helps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import UserError
from ..files import write_atomic
from . import checkpointing as ckpt
from .phema import check_std, reconstruct
from .run_evaluation import CONFIG_FILE, build_run_evaluator, evaluation_inputs
from .config import load_config

SWEEP_FILE = "ema_sweep.json"


def sweep_ema(run_dir: Path, stds: Sequence[float], seeds: tuple[int, int] = (0, 1), cpu: bool = False,
              log: Callable[[str], Any] = print) -> dict[str, Any]:
    """RUN/ema_sweep.json: {"step", "seeds", "metrics": {name: [metrics on seed 0, on seed 1]}}, names
    `ema` and `std <s>`, at the newest checkpoint (which the snapshots must reach)."""
    from ..checkpoint import build_model, load_trained_model
    from ..cli import job_processes

    run_dir = Path(run_dir)
    for std in stds:  # all of them before anything is evaluated
        check_std(std, "--stds")
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir} has no checkpoint; train it first (with train.phema)")
    step, folder = found[-1]
    configs = [load_config(run_dir / CONFIG_FILE, [f"eval.seed={s}"]) for s in seeds]
    with job_processes(cpu, configs[0].train.collective_timeout_s) as state:
        spec, data, objective, decoder = evaluation_inputs(configs[0], folder, state)
        models = {"ema": load_trained_model(folder, "ema", state.device)[0]}
        for std in stds:
            weights, _, _ = reconstruct(run_dir, std, step, "--stds")
            model = build_model(spec, weights)
            model.load_state_dict(weights)
            models[f"std {std:g}"] = model.to(state.device).eval()
        metrics: dict[str, list] = {name: [] for name in models}
        for config in configs:
            evaluator = build_run_evaluator(config, data, objective, decoder, state)
            for name, model in models.items():
                result = evaluator.evaluate(model)
                if result is not None:
                    metrics[name].append(result["metrics"])
                    log(f"{run_dir.name} step {step} seed {config.eval.seed}: {name}: "
                        + ", ".join(f"{k} {v:.4g}" for k, v in result["metrics"].items()))
    sweep = {"step": step, "seeds": list(seeds), "metrics": metrics}
    if state.is_main_process:
        write_atomic(run_dir / SWEEP_FILE, (json.dumps(sweep, indent=1) + "\n").encode())
    return sweep


def compare_sweeps(sweeps: dict[str, dict[str, Any]], metric: str) -> str:
    """The verdict across runs (one per seed): per run the std best on the first evaluation seed, its
    value and the fixed EMA's on the second, and the paired difference's mean with a 95% interval."""
    from ..evaluation.metric_registry import lower_is_better
    from ..evaluation.stats import mean_t_interval

    lower = lower_is_better(metric)
    lines, diffs = [f"metric {metric} ({'lower' if lower else 'higher'} is better); best std picked on evaluation "
                    "seed A, scored on seed B"], []
    for run, sweep in sweeps.items():
        m = sweep["metrics"]
        if metric not in m["ema"][0]:
            raise UserError(f"{run}'s sweep has no {metric}; choose one of {', '.join(m['ema'][0])}")
        stds = [k for k in m if k != "ema"]
        pick = (min if lower else max)(stds, key=lambda k: m[k][0][metric])
        diffs.append(m[pick][1][metric] - m["ema"][1][metric])
        lines.append(f"{run}: best {pick} -> {m[pick][1][metric]:.4g}; fixed EMA {m['ema'][1][metric]:.4g}; "
                     f"difference {diffs[-1]:+.4g}")
    interval = mean_t_interval(diffs)
    if interval.low is None:
        return "\n".join(lines + [f"one run: difference {diffs[0]:+.4g}, no interval (sweep a run per seed)"])
    better = interval.high < 0 if lower else interval.low > 0
    worse = interval.low > 0 if lower else interval.high < 0
    verdict = "post-hoc EMA is better" if better else "post-hoc EMA is worse" if worse else "no measurable difference"
    lines.append(f"paired difference (post-hoc - fixed) over {len(diffs)} seed(s): {interval.mean:+.4g}, 95% interval "
                 f"[{interval.low:+.4g}, {interval.high:+.4g}]: {verdict}")
    return "\n".join(lines)
