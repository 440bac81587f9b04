"""Typed training configuration: YAML file + `section.key=value` overrides -> Config.

Sections follow DESIGN.md (run_dir, model, data, train; plus log). Unknown keys and values of the
wrong type are rejected with one line naming the key. Checked by hand on dataclasses with PyYAML
(not OmegaConf) so the package needs no dependency beyond the ones pyproject already lists.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from ..models import DIT_MODELS, TOPOLOGIES
from ..models.topologies import all_topology_options, resolve_options

DATA_KINDS = ("digits", "latents", "images")
PRECISIONS = ("no", "bf16", "fp16")


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
    sample_steps: int = 50            # DDPM steps of the grid sampler
    seed: int = 0
    compile: bool = False
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~1 more forward)
    tf32: bool = True


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
    log: LogConfig = field(default_factory=LogConfig)


def _type_name(tp: Any) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in typing.get_args(tp)) \
        if typing.get_args(tp) else tp.__name__


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp` (int, float, bool, str or X | None)."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
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
    return config


def validate_config(config: Config) -> None:
    """Checks that need neither the data nor the process group; one UserError each."""
    m, d, t = config.model, config.data, config.train
    if m.name not in DIT_MODELS:
        raise UserError(f"unknown model {m.name!r} in model.name; choose one of {', '.join(DIT_MODELS)}")
    if m.topology not in TOPOLOGIES:
        raise UserError(f"unknown topology {m.topology!r} in model.topology; choose one of {', '.join(TOPOLOGIES)}")
    topology_options_of(m)  # the topology's own checks (e.g. tau > 0, frozen's topology_path)
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
                    out[f"{section}.{key}" + (f".{name}" if name else "")] = "null" if item is None else item
        else:
            out[section] = values
    return out
