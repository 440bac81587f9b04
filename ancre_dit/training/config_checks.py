"""A config's checks beyond its types: each value is checked by building what uses it (the model on the
meta device, the objective, sampler, guidance, REPA's encoder), plus the rules tying sections together.
Read away from its data (a study's status or report), missing paths are listed instead of refused."""
from __future__ import annotations

from pathlib import Path

from ..diffusion import build_objective
from ..errors import UserError
from ..evaluation.evaluator import check_evaluation
from ..sampling.guidance import check_guidance_scale
from .config_sections import Config
from .data import check_data_path
from .lr_schedule import check_lr_schedule
from .model_setup import check_model, diffusion_spec
from .phema import check_ema_choices
from .repa import check_repa_settings


def validate_config(config: Config, check_paths: bool = True) -> list[str]:
    """One UserError for the first problem; records the topology's options in model.topology_options.
    Returns the paths not found here, as key=value (none when `check_paths`: each is an error)."""
    missing: list[str] = []

    def found(key: str, value: str, kind: str = "file") -> bool:
        """Whether the path exists; without `check_paths` a missing one is listed and counts as found."""
        if {"file": Path.is_file, "dir": Path.is_dir, "any": Path.exists}[kind](Path(value)):
            return True
        if not check_paths:
            missing.append(f"{key}={value}")
        return not check_paths

    check_model(config, found)
    _check_sparsify_step(config)
    check_lr_schedule(config.train)
    check_ema_choices(config.train, config.eval.emas)
    check_data_path(config, found)
    objective = build_objective(diffusion_spec(config))
    check_repa_settings(config.repa, found)
    check_guidance_scale("train.cfg_scale_for_grids", config.train.cfg_scale_for_grids)
    check_evaluation(config.eval, config.data.kind, objective, found)
    return list(dict.fromkeys(missing))


def _check_sparsify_step(config: Config) -> None:
    """Sparse ANCRe: model.topology_topk and the step come together, within the run."""
    topk, step, t = config.model.topology_topk, config.train.topology_sparsify_step, config.train
    if topk and not step:
        raise UserError(f"model.topology_topk={topk} needs train.topology_sparsify_step (the step "
                        "after which each block keeps its strongest edges)")
    if step and not topk:
        raise UserError(f"train.topology_sparsify_step={step} needs model.topology_topk (the edges each block keeps)")
    if step > t.max_steps:
        raise UserError(f"train.topology_sparsify_step={step} is beyond train.max_steps={t.max_steps}; "
                        "choose a step within the run")
