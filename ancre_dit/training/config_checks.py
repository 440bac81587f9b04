"""A config's checks beyond its types: each value is checked by building what uses it (the model on the
meta device, the objective, sampler, guidance, REPA's encoder), plus the rules tying sections together.
Read away from its data (a study's status or report), missing paths are listed instead of refused."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..diffusion import build_objective
from ..diffusion.sampler_registry import check_time_shift, resolve_sampler
from ..errors import MissingFileError, UserError, or_list
from ..evaluation.evaluator import resolve_metrics
from ..evaluation.inception import weights_hint as inception_weights_hint
from ..evaluation.metric_registry import METRICS, TRAINING_METRICS, stored_stat_keys
from ..models import create_model
from ..models.dit import model_size
from ..models.timm_weights import weights_hint as timm_weights_hint
from ..models.topologies import all_topology_options, resolve_options, topology_entry
from ..models.topologies.aggregation import check_aggregation_kernel
from ..sampling.guidance import check_guidance_scale
from .config_sections import Config, EvalConfig, ModelConfig
from .data import check_data_path
from .ema import ema_names
from .lr_schedule import check_lr_schedule
from .phema import check_phema_settings
from .model_setup import model_kwargs, topology_options_of
from .repa import check_repa_settings


class _Paths:
    """Existence checks: with `check` a missing path fails; without, it is listed (key=value) and passes."""

    def __init__(self, check: bool):
        self.check = check
        self.missing: list[str] = []

    def found(self, key: str, value: str, kind: str = "file") -> bool:
        path = Path(value)
        if {"file": path.is_file, "dir": path.is_dir, "any": path.exists}[kind]():
            return True
        if not self.check:
            self.missing.append(f"{key}={value}")
        return not self.check


def validate_config(config: Config, check_paths: bool = True) -> list[str]:
    """One UserError for the first problem; records the topology's options in model.topology_options.
    Returns the paths not found here, as key=value (none when `check_paths`: each is an error)."""
    paths = _Paths(check_paths)
    if _resolve_topology_options(config.model, paths):
        _build_model(config)
    _check_sparsify_step(config)
    check_lr_schedule(config.train)
    _check_ema_decays(config.train.ema_decay, config.train.ema_decays)
    _check_eval_emas(config)
    _check_eval_guide(config.eval, paths)
    check_phema_settings(config.train.phema.stds, config.train.phema.snapshot_every)
    check_data_path(config.data, paths.found)
    objective = build_objective(diffusion_spec(config))
    check_repa_settings(config.repa, paths.found)
    _check_eval_data(config, paths)
    e = config.eval
    resolve_sampler(objective, e.sampler, e.steps, ("eval.sampler", "eval.steps"),
                    owner=f"diffusion.objective={objective.name}")
    check_time_shift(e.sampler or objective.default_sampler, e.time_shift, "eval.time_shift")
    check_guidance_scale("train.cfg_scale_for_grids", config.train.cfg_scale_for_grids)
    for scale in e.cfg_scales:
        check_guidance_scale("eval.cfg_scales", scale)
    _check_eval_metrics(config, paths)
    return list(dict.fromkeys(paths.missing))


def _resolve_topology_options(m: ModelConfig, paths: _Paths) -> bool:
    """Checks the topology options given and the files they name; records them with the defaults, in
    the registry's order (config.yaml then holds them, byte-stable); other topologies' options stay
    as given. False when a file it names is missing here (unchecked)."""
    resolved = resolve_options(m.topology, m.topology_options, prefix="model.", keep_others=True)
    unlisted = len(paths.missing)
    for key, option in topology_entry(m.topology).options.items():
        if option.file and resolved[key] is not None and not paths.found(f"model.{key}", resolved[key]):
            raise MissingFileError(f"model.{key} {resolved[key]} not found; pass an existing file ({option.help})")
    m.topology_options = {key: resolved[key] for key in all_topology_options() if key in resolved}
    return len(paths.missing) == unlisted


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


def _check_ema_decays(decay: float, extra: list[float]) -> None:
    """Each EMA once: its weights file is named by its decay."""
    for d in extra:
        if d == decay or extra.count(d) > 1:
            what = "the decay of train.ema_decay" if d == decay else "given twice"
            raise UserError(f"train.ema_decays holds {d:g}, {what}; keep each EMA once")


def _check_eval_guide(e: EvalConfig, paths: _Paths) -> None:
    from ..checkpoint import SPEC_FILE

    if e.guide_ckpt and not paths.found("eval.guide_ckpt", str(Path(e.guide_ckpt) / SPEC_FILE)):
        raise MissingFileError(f"eval.guide_ckpt {e.guide_ckpt} is no checkpoint folder ({SPEC_FILE} missing); "
                               "point it at RUN/checkpoints/<step> of a model of the same data")


def _check_eval_emas(config: Config) -> None:
    kept = ema_names(config.train)
    for name in config.eval.emas:
        if name not in kept:
            raise UserError(f"eval.emas names {name}, which this run does not keep; choose from {', '.join(kept)} "
                            "(more with train.ema_decays or train.phema.stds)")


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


def diffusion_spec(config: Config) -> dict[str, Any]:
    """The diffusion section as the spec `ancre_dit.diffusion.build_objective` reads."""
    return {**dataclasses.asdict(config.diffusion), "learn_sigma": config.model.learn_sigma}


def _check_eval_data(config: Config, paths: _Paths) -> None:
    e = config.eval
    if (e.heldout_from_train or e.val_path) and config.data.kind != "latents":
        raise UserError("eval.val_path and eval.heldout_from_train apply to data.kind=latents only "
                        "(digits use their held-out split); remove them")
    if e.val_path and e.heldout_from_train:
        raise UserError("set eval.val_path or eval.heldout_from_train, not both")
    if e.val_path and not paths.found("eval.val_path", e.val_path, "dir"):
        raise UserError(f"eval.val_path {e.val_path} does not exist; point it at a latent directory "
                        f"written by scripts/extract_latents.py")


def _check_eval_metrics(config: Config, paths: _Paths) -> None:
    """What the metrics asked for need (the metric table says): their data, a reference, the weights
    of the network whose features they read."""
    e, kind = config.eval, config.data.kind
    metrics = resolve_metrics(e, kind)
    for name in metrics:
        if name not in TRAINING_METRICS:
            raise UserError(f"unknown metric {name!r} in eval.metrics; choose {or_list(TRAINING_METRICS)}")
        only = METRICS[name].only_for
        if only is not None and only[0] != kind:
            raise UserError(f"eval.metrics={name} scores {only[1]}, but data.kind={kind}; use fid (with eval.ref)")
    dinov2 = ", ".join(m for m in metrics if METRICS[m].features == "dinov2")
    if dinov2:
        keys = " / ".join(stored_stat_keys(m for m in metrics if METRICS[m].features == "dinov2"))
        if not e.ref or not paths.found("eval.ref", e.ref, "any"):
            raise MissingFileError(f"eval.metrics {dinov2} needs eval.ref (an npz with images or {keys}, "
                                   f"or a folder of images); got {e.ref}")
        if not e.dinov2_weights or not paths.found("eval.dinov2_weights", e.dinov2_weights):
            raise MissingFileError(f"eval.metrics {dinov2} needs eval.dinov2_weights (got {e.dinov2_weights}); "
                                   f"{timm_weights_hint(e.dinov2_model, 'eval.dinov2_weights=PATH')}")
    inception = ", ".join(m for m in metrics if METRICS[m].features == "inception")
    if not inception:
        return
    if not e.ref:
        raise UserError(f"eval.metrics {inception} need eval.ref (an ADM reference npz or one written by "
                        f"evaluate.py --save-ref-stats)")
    if not paths.found("eval.ref", e.ref, "any"):
        raise MissingFileError(f"eval.ref {e.ref} does not exist; pass an ADM reference npz or a file written by "
                               f"evaluate.py --save-ref-stats")
    if not e.inception_weights or not paths.found("eval.inception_weights", e.inception_weights):
        problem = (f"eval.inception_weights {e.inception_weights} does not exist" if e.inception_weights
                   else "eval.inception_weights is not set")
        raise MissingFileError(inception_weights_hint(f"{problem} ({inception})", "eval.inception_weights="))


def check_batch_layout(config: Config, num_processes: int) -> int:
    """Per-device micro-batch = global batch / (processes x accumulation); a UserError if it does not divide."""
    t = config.train
    parts = num_processes * t.grad_accum
    if t.global_batch_size % parts:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by {num_processes} "
                        f"process(es) x {t.grad_accum} accumulation step(s) = {parts}; choose a multiple of {parts}")
    return t.global_batch_size // parts
