"""Typed training configuration: YAML file + `section.key=value` overrides -> Config.

Sections follow DESIGN.md (run_dir, model, data, train, eval; plus log). Unknown keys and values of the
wrong type are rejected with one line naming the key. Checked by hand on dataclasses with PyYAML
(not OmegaConf) so the package needs no dependency beyond the ones pyproject already lists.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from ..models import DIT_MODELS, TOPOLOGIES
from ..models.topologies import all_topology_options, resolve_options
from ..models.dit import DIT_SIZES

DATA_KINDS = ("digits", "latents", "images")
PRECISIONS = ("no", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "stop")  # train.nonfinite (training/guards.py)


@dataclass
class ModelConfig:
    name: str = "DiT-S/2"
    topology: str = "ancre"
    tau: float = 0.01
    learn_sigma: bool = True
    class_dropout: float = 0.1
    depth: int | None = None          # overrides of the named size (small custom models)
    hidden_size: int | None = None
    num_heads: int | None = None
    topology_path: str | None = None  # topology.json for topology "frozen"
    hc_streams: int = 4               # residual streams of hc / hc-dynamic / mhc
    sinkhorn_iters: int = 20          # Sinkhorn-Knopp iterations of mhc
    # Weight of the Tsallis-entropy (q = 2) penalty on ANCRe's incoming weights, added to the loss
    # to push toward sparse topologies (ancre_dit.models.topologies.analysis.tsallis_entropy); 0 = off.
    topology_entropy_weight: float = 0.0
    # Options of other registered topologies (`model.<option>=value`): the registry
    # (models/topologies/registry.py) declares which keys exist and their types.
    topology_options: dict = field(default_factory=dict)


def topology_options_of(m: ModelConfig) -> dict[str, Any]:
    """The options the chosen topology is built with (checked by the topology's registry entry)."""
    given = dict(m.topology_options)
    for key in all_topology_options():
        if key in {f.name for f in dataclasses.fields(ModelConfig)}:
            given[key] = getattr(m, key)
    return resolve_options(m.topology, given)


@dataclass
class DataConfig:
    kind: str = "latents"
    path: str | None = None           # latent dir (latents) or ImageFolder root (images)
    image_size: int = 256             # pixels of the decoded image
    num_workers: int = 4
    vae: str | None = None            # local VAE folder for sample grids (latents; default: manifest's)
    in_memory: bool = False           # latents: load every shard into RAM once (batches are then an index_select)


@dataclass
class TrainConfig:
    global_batch_size: int = 256
    max_steps: int = 400_000
    lr: float = 1.0e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    grad_clip: float = 0.0            # max global grad norm; 0 = off
    ema_decay: float = 0.9999
    ema_warmup: bool = False          # ramp the decay up from 0 (timm's warmup), for short runs
    mixed_precision: str = "bf16"
    grad_accum: int = 1
    ckpt_every: int = 50_000
    keep_last: int = 0                # keep the newest N checkpoints; 0 = keep all
    log_every: int = 100
    sample_every: int = 10_000        # EMA sample grid; 0 = never
    num_sample_images: int = 16
    cfg_scale_for_grids: float = 4.0
    sample_steps: int = 50            # steps of the grid sampler (the objective's default one)
    eval_every: int = 0               # evaluation (see EvalConfig) every N steps and at the end; 0 = never
    seed: int = 0
    nonfinite: str = "skip"           # non-finite loss / grad norm: skip the update, or stop the run
    nonfinite_max_skips: int = 10     # with skip: stop after more than this many in a row
    compile: bool = False
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~1 more forward)
    tf32: bool = True


EVAL_METRICS = ("digits", "fid", "sfid", "is", "precision", "recall")


@dataclass
class EvalConfig:
    """What an evaluation measures (run every train.eval_every steps, and by `evaluate.py --run`).

    Samples come from the EMA weights with a fixed seed, sampler and step count, once per cfg scale.
    `metrics`: "digits" (held-out classifier accuracy + Fréchet distance on that classifier's
    features; NOT FID) and/or Inception metrics (fid, sfid, is, precision, recall) against `ref`;
    null = digits on digits data, fid when `ref` is set, else none (held-out loss only)."""
    num_samples: int = 1000
    batch_size: int = 250             # images per sampling part (part j goes to process j % world)
    sampler: str | None = None        # null: the objective's default (DDPM: ddpm; flow: heun)
    steps: int | None = None          # null: that sampler's default step count
    cfg_scales: list[float] = field(default_factory=lambda: [1.0])
    seed: int = 0
    metrics: list[str] | None = None
    ref: str | None = None            # ADM reference npz, or one from evaluate.py --save-ref-stats
    inception_weights: str | None = None
    heldout_loss: bool = True         # loss on fixed held-out examples with fixed noise and times
    heldout_draws: int = 4            # (noise, time) pairs per held-out example
    heldout_max: int = 1000           # at most this many held-out examples (the first ones)
    val_path: str | None = None       # latents: a latent directory of held-out examples
    heldout_from_train: int = 0       # latents: hold out the last N training samples (training skips them)


@dataclass
class DiffusionConfig:
    objective: str = "ddpm"           # ddpm (DiT) or flow (SiT's linear interpolant, velocity)
    time_sampling: str = "uniform"    # flow: training time uniform (SiT) or logit-normal (SD3)
    logit_mean: float = 0.0           # logit-normal location
    logit_std: float = 1.0            # logit-normal scale


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb: bool = False
    project: str = "ancre-dit"


@dataclass
class Config:
    run_dir: str = "results/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _type_name(tp: Any) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in typing.get_args(tp)) \
        if typing.get_args(tp) else tp.__name__


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp` (int, float, bool, str or X | None)."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    if typing.get_origin(tp) is list or any(typing.get_origin(o) is list for o in options):
        return _coerce_list(value, tp, key)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"config key {key} must be {_type_name(tp)}, got null")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):  # PyYAML reads "1e-4" (no dot) as a string
                try:
                    return float(value)
                except ValueError:
                    pass
        if option is str and isinstance(value, str):
            return value
        if option is str and value is False and key == "train.mixed_precision":
            return "no"  # YAML 1.1 reads an unquoted `no` as false
    raise UserError(f"config key {key} must be {_type_name(tp)}, got {value!r}")


def _coerce_list(value: Any, tp: Any, key: str) -> Any:
    """A list annotation (list[float], list[str] | None): a scalar becomes a one-item list."""
    options = typing.get_args(tp) if typing.get_origin(tp) is not list else (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"config key {key} must be a list, got null")
    item_type = typing.get_args(next(o for o in options if typing.get_origin(o) is list))[0]
    items = value if isinstance(value, list) else [value]
    if not items:
        raise UserError(f"config key {key} must not be an empty list")
    return [_coerce(item, item_type, key) for item in items]


def _topology_option(key: str, value: Any, full: str) -> Any:
    option = all_topology_options()[key]
    return _coerce(value, option.type | None if option.optional else option.type, full)


def _build(cls: type, values: Any, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise UserError(f"config section {prefix or 'top level'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if cls is ModelConfig and key == "topology_options":  # as written back into config.yaml
            if not isinstance(value, dict):
                raise UserError(f"config key {full} must be a mapping of topology options, got {value!r}")
            for sub, item in value.items():
                if sub not in all_topology_options():
                    raise UserError(f"unknown topology option {full}.{sub}; registered options: "
                                    f"{', '.join(sorted(all_topology_options()))}")
                kwargs.setdefault("topology_options", {})[sub] = _topology_option(sub, item, f"{full}.{sub}")
            continue
        if cls is ModelConfig and key not in hints and key in all_topology_options():
            kwargs.setdefault("topology_options", {})[key] = _topology_option(key, value, full)
            continue
        if key not in hints:
            raise UserError(f"unknown config key {full}; valid keys{' of ' + prefix[:-1] if prefix else ''}: "
                            f"{', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _merge(base: dict, key_path: list[str], value: Any) -> None:
    node = base
    for part in key_path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {'.'.join(key_path)}: {part} is not a section")
        node = child
    node[key_path[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads the YAML at `path` (or the defaults when None), applies `a.b=value` overrides
    (values parsed as YAML) and validates what needs no data or processes."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found; pass --config configs/<name>.yaml")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a mapping with sections run_dir, model, data, train")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r} is not key=value (e.g. train.max_steps=20)")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        _merge(raw, key.strip().split("."), value)
    config = _build(Config, raw, "")
    validate_config(config)
    validate_diffusion(config)
    return config


def validate_config(config: Config) -> None:
    """Checks that need neither the data nor the process group; one UserError each."""
    m, d, t = config.model, config.data, config.train
    if m.name not in DIT_MODELS:
        raise UserError(f"unknown model {m.name!r} in model.name; choose one of {', '.join(DIT_MODELS)}")
    if m.topology not in TOPOLOGIES:
        raise UserError(f"unknown topology {m.topology!r} in model.topology; choose one of {', '.join(TOPOLOGIES)}")
    if not 0 <= m.topology_entropy_weight < float("inf"):
        raise UserError(f"model.topology_entropy_weight must be a finite number >= 0 (0 = off), "
                        f"got {m.topology_entropy_weight}")
    if not 0 <= m.class_dropout < 1:
        raise UserError(f"model.class_dropout must be in [0, 1), got {m.class_dropout}")
    if d.kind not in DATA_KINDS:
        raise UserError(f"unknown data kind {d.kind!r} in data.kind; choose one of {', '.join(DATA_KINDS)}")
    if d.kind in ("latents", "images"):
        if not d.path:
            raise UserError(f"data.kind={d.kind} needs data.path (the {'latent directory' if d.kind == 'latents' else 'image folder'})")
        if not Path(d.path).is_dir():
            raise UserError(f"data path {d.path} does not exist; set data.path to the "
                            f"{'directory written by scripts/extract_latents.py' if d.kind == 'latents' else 'ImageFolder root (one folder per class)'}")
    if t.mixed_precision not in PRECISIONS:
        raise UserError(f"train.mixed_precision must be one of {', '.join(PRECISIONS)}, got {t.mixed_precision!r}")
    for key in ("global_batch_size", "max_steps", "grad_accum", "ckpt_every", "log_every"):
        if getattr(t, key) < 1:
            raise UserError(f"train.{key} must be at least 1, got {getattr(t, key)}")
    for key in ("warmup_steps", "keep_last", "sample_every", "num_sample_images", "num_workers"):
        owner = d if key == "num_workers" else t
        if getattr(owner, key) < 0:
            raise UserError(f"{'data' if owner is d else 'train'}.{key} must be >= 0, got {getattr(owner, key)}")
    if not 0 <= t.ema_decay <= 1:
        raise UserError(f"train.ema_decay must be in [0, 1], got {t.ema_decay}")
    if t.lr <= 0:
        raise UserError(f"train.lr must be positive, got {t.lr}")
    _check_ranges(config)
    topology_options_of(m)  # the chosen topology's own checks (e.g. frozen's topology_path)
    validate_eval_config(config)


def _check_ranges(config: Config) -> None:
    """Every other number with a valid range: one that is out of it would train NaN (tau = 0 divides
    the topology logits by zero) or fail deep inside torch with a traceback."""
    m, d, t = config.model, config.data, config.train
    for section in ("model", "data", "train"):
        values = getattr(config, section)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{section}.{f.name} must be a finite number, got {value}")
    for key, option in all_topology_options().items():  # ranges the registry declares (tau > 0, ...)
        option.check(f"model.{key}", getattr(m, key) if hasattr(m, key) else m.topology_options.get(key))
    for key in ("depth", "hidden_size", "num_heads"):
        if getattr(m, key) is not None and getattr(m, key) < 1:
            raise UserError(f"model.{key} must be at least 1 (or null for the named size), got {getattr(m, key)}")
    for owner, section, key in ((d, "data", "image_size"), (t, "train", "sample_steps")):
        if getattr(owner, key) < 1:
            raise UserError(f"{section}.{key} must be at least 1, got {getattr(owner, key)}")
    for key in ("weight_decay", "grad_clip", "cfg_scale_for_grids", "seed", "nonfinite_max_skips"):
        if getattr(t, key) < 0:
            raise UserError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise UserError(f"train.{key} must be in [0, 1), got {getattr(t, key)}")
    size = DIT_SIZES[DIT_MODELS[m.name][0]]  # (depth, width, heads) of the named size
    width, heads = m.hidden_size or size[1], m.num_heads or size[2]
    if width % heads:  # checked here too, so that a run dir is never created for it
        raise UserError(f"model.hidden_size={width} is not divisible by model.num_heads={heads}; change one of them")
    if t.nonfinite not in NONFINITE_POLICIES:
        raise UserError(f"train.nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {t.nonfinite!r}")


def diffusion_spec(config: Config) -> dict[str, Any]:
    """The diffusion section as the spec `ancre_dit.diffusion.build_objective` reads."""
    return {**dataclasses.asdict(config.diffusion), "learn_sigma": config.model.learn_sigma}


def validate_diffusion(config: Config) -> None:
    """The diffusion section, checked by building its objective (one UserError naming the key)."""
    from ..diffusion import OBJECTIVES, build_objective

    d = config.diffusion
    if d.objective not in OBJECTIVES:
        raise UserError(f"unknown objective {d.objective!r} in diffusion.objective; choose {' or '.join(OBJECTIVES)}")
    if d.objective != "flow" and d.time_sampling != "uniform":
        raise UserError(f"diffusion.time_sampling={d.time_sampling} applies only to diffusion.objective=flow "
                        "(DDPM draws integer timesteps uniformly)")
    build_objective(diffusion_spec(config))


def validate_eval_config(config: Config) -> None:
    """The eval section's own checks (also run by `evaluate.py --run` after its overrides)."""
    e, t = config.eval, config.train
    if t.eval_every < 0:
        raise UserError(f"train.eval_every must be >= 0 (0 = no evaluation), got {t.eval_every}")
    for key in ("num_samples", "batch_size", "steps", "heldout_draws", "heldout_max"):
        if getattr(e, key) is not None and getattr(e, key) < 1:
            raise UserError(f"eval.{key} must be at least 1, got {getattr(e, key)}")
    if e.heldout_from_train < 0:
        raise UserError(f"eval.heldout_from_train must be >= 0, got {e.heldout_from_train}")
    for name in e.metrics or ():
        if name not in EVAL_METRICS:
            raise UserError(f"unknown metric {name!r} in eval.metrics; choose from {', '.join(EVAL_METRICS)}")
    if any(s <= 0 for s in e.cfg_scales):
        raise UserError(f"eval.cfg_scales must be positive (1.0 = no guidance), got {e.cfg_scales}")
    if (e.heldout_from_train or e.val_path) and config.data.kind != "latents":
        raise UserError("eval.val_path and eval.heldout_from_train apply to data.kind=latents only "
                        "(digits use their held-out split); remove them")
    if e.val_path and e.heldout_from_train:
        raise UserError("set eval.val_path or eval.heldout_from_train, not both")
    if e.val_path and not Path(e.val_path).is_dir():
        raise UserError(f"eval.val_path {e.val_path} does not exist; point it at a latent directory "
                        f"written by scripts/extract_latents.py")


def check_batch_layout(config: Config, num_processes: int) -> int:
    """Per-device micro-batch = global batch / (processes x accumulation); a UserError if it does not divide."""
    t = config.train
    parts = num_processes * t.grad_accum
    if t.global_batch_size % parts:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by {num_processes} "
                        f"process(es) x {t.grad_accum} accumulation step(s) = {parts}; choose a multiple of {parts}")
    return t.global_batch_size // parts


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def flat_config(config: Config) -> dict[str, Any]:
    """{"train.lr": 1e-4, ...} with only bool/int/float/str values (what trackers accept)."""
    out = {}
    for section, values in config_to_dict(config).items():
        if isinstance(values, dict):
            for key, value in values.items():
                for name, item in (value.items() if isinstance(value, dict) else [(None, value)]):
                    if isinstance(item, list):  # trackers take scalars only
                        item = ",".join(str(v) for v in item)
                    out[f"{section}.{key}" + (f".{name}" if name else "")] = "null" if item is None else item
        else:
            out[section] = values
    return out
