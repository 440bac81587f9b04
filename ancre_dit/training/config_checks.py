"""A config's checks beyond its types: each value is checked by building what uses it (the model on the
meta device, the objective, sampler, guidance, REPA's encoder), plus the rules tying sections together.
Read away from its data (a study's status or report), missing paths are listed instead of refused."""
from __future__ import annotations

from pathlib import Path

import torch

from ..diffusion import build_objective
from ..errors import MissingFileError, UserError
from ..evaluation.evaluator import check_evaluation
from ..models import create_model
from ..models.dit import model_size
from ..models.topologies import all_topology_options, resolve_options, topology_entry
from ..models.topologies.aggregation import check_aggregation_kernel
from ..sampling.guidance import check_guidance_scale
from .config_sections import Config, ModelConfig
from .data import check_data_path
from .ema import check_ema_choices
from .lr_schedule import check_lr_schedule
from .model_setup import diffusion_spec, model_kwargs, topology_options_of
from .phema import check_phema_settings
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

    if _resolve_topology_options(config.model, found):
        _build_model(config)
    _check_sparsify_step(config)
    check_lr_schedule(config.train)
    check_ema_choices(config.train, config.eval.emas)
    check_phema_settings(config.train.phema.stds, config.train.phema.snapshot_every)
    check_data_path(config, found)
    objective = build_objective(diffusion_spec(config))
    check_repa_settings(config.repa, found)
    check_guidance_scale("train.cfg_scale_for_grids", config.train.cfg_scale_for_grids)
    check_evaluation(config.eval, config.data.kind, objective, found)
    return list(dict.fromkeys(missing))


def _resolve_topology_options(m: ModelConfig, found) -> bool:
    """Checks the topology options given and the files they name; records them with the defaults, in
    the registry's order (config.yaml then holds them, byte-stable); other topologies' options stay
    as given. False when a file it names is missing here (unchecked)."""
    resolved = resolve_options(m.topology, m.topology_options, prefix="model.", keep_others=True)
    all_found = True
    for key, option in topology_entry(m.topology).options.items():
        if option.file and resolved[key] is not None and not Path(resolved[key]).is_file():
            if not found(f"model.{key}", resolved[key]):
                raise MissingFileError(f"model.{key} {resolved[key]} not found; pass an existing file ({option.help})")
            all_found = False
    m.topology_options = {key: resolved[key] for key in all_topology_options() if key in resolved}
    return all_found


def _build_model(config: Config) -> None:
    """The network on the meta device (no memory, no initialisation): its size, layers, topology and
    aggregation settings check themselves. The data's shape is build_data's check; a stand-in here."""
    m = config.model
    if m.topology_entropy_weight and not topology_entry(m.topology).incoming_softmax:
        raise UserError(f"model.topology_entropy_weight needs the ancre topology (a learned softmax over each "
                        f"block's incoming edges), not {m.topology}; set it to 0 or use model.topology=ancre")
    kwargs = model_kwargs(m, input_size=8 * (m.patch_size or 1), in_channels=4, num_classes=10)  # a fitting stand-in
    # The topology on the CPU (small; some read their values at build), the rest on meta. Its options
    # were checked just above (resolve_options): the entry's builder trusts them.
    size = {**model_size(m.name), **kwargs}
    kwargs["topology"] = topology_entry(m.topology).build(size["depth"], size["hidden_size"], **topology_options_of(m))
    with torch.device("meta"):
        model = create_model(m.name, **kwargs)
    check_aggregation_kernel(m.aggregation_kernel, cuda=torch.cuda.is_available())  # where the run will be
    blocks = len(model.blocks)
    if config.repa.weight and config.repa.depth > blocks:
        raise UserError(f"repa.depth={config.repa.depth} is beyond the {blocks} blocks of {m.name}; choose "
                        f"1..{blocks} (REPA aligns block 8 of 12-block models)")


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
