"""Typed training configuration: a YAML file + `section.key=value` overrides -> Config.

The dataclasses below are the schema (sections run_dir, model, data, train, diffusion, repa, eval, log).
OmegaConf merges the file and then each override onto them as structured configs, so unknown keys
and values of the wrong type are refused there; its errors come out as one UserError line naming
the key. Each field declares its valid range or choices beside it (`ranged`, `choice`, `checked`),
checked by one loop (`check_fields`); what involves several fields or the file system is a small
function of its own. All of it runs inside load_config, before anything is written, so a bad
setting never leaves a half-made run folder behind.

A topology's own hyperparameters (model.tau, model.hc_streams, ...) are not fields here: the
topology registry (models/topologies/registry.py) declares them with their types, defaults and
ranges, ModelConfig.topology_options holds them, and config.yaml holds them flat as model.<option>.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError

from ..diffusion import ALL_SAMPLERS, OBJECTIVES, TIME_SAMPLINGS, Objective, build_objective
from ..errors import MissingFileError, UserError
from ..evaluation.evaluator import EVAL_METRICS, resolve_metrics
from ..evaluation.inception import WEIGHTS_NAME, WEIGHTS_URL
from ..evaluation.pipeline import ADM_METRICS
from ..models import DIT_MODELS, TOPOLOGIES
from ..models.dit import DIT_SIZES
from ..models.layers import MLPS, NORMS, POS_EMBEDS
from ..models.topologies import all_topology_options, resolve_options
from ..sampling.guidance import check_guidance_scale

DATA_KINDS = ("digits", "latents", "images")
PRECISIONS = ("no", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "stop")  # train.nonfinite (training/guards.py)
_RULE = "rule"  # the dataclasses.field metadata key of a field's Rule


def _or_list(names: Iterable[str]) -> str:
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class Rule:
    """What a field accepts beyond its type, declared beside it (as TopologyOption declares an
    option's range) so that one loop checks every field the same way. A list field's rule
    applies to each item; None (an unset optional field) is never checked."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    hint: str = ""  # what special values mean (e.g. "0 = off"), shown with a range error
    # Names the value must be one of: a tuple, or a registry dict (read when checked, so that
    # topologies registered after this module count).
    choices: Iterable[str] | None = None
    noun: str | None = None  # "unknown <noun> 'x' in <key>; choose ..." rather than "<key> must be one of ..."
    check: Callable[[str, Any], None] | None = None  # a rule defined elsewhere: check(key, value)

    def options(self) -> tuple[str, ...]:
        return tuple(self.choices or ())

    def __call__(self, key: str, value: Any) -> None:
        if self.choices is not None and value not in self.options():
            raise UserError(f"unknown {self.noun} {value!r} in {key}; choose {_or_list(self.options())}" if self.noun
                            else f"{key} must be one of {_or_list(self.options())}, got {value!r}")
        if self.check is not None:
            self.check(key, value)
        inside = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if not inside:
            raise UserError(f"{key} must be {self._words()}{f' ({self.hint})' if self.hint else ''}, got {value}")

    def _words(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        if self.gt == 0:
            return "positive"
        if self.gt is not None:
            return f"> {self.gt:g}"
        return ">= 0" if self.ge == 0 else f"at least {self.ge:g}"


def _declared(default: Any, rule: Rule) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={_RULE: rule})
    return field(default=default, metadata={_RULE: rule})


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, hint: str = "") -> Any:
    """A numeric field with its valid range, e.g. `lr: float = ranged(1e-4, gt=0)`."""
    return _declared(default, Rule(ge=ge, gt=gt, le=le, lt=lt, hint=hint))


def choice(default: Any, choices: Iterable[str], noun: str | None = None) -> Any:
    """A field that names one of `choices`, e.g. `kind: str = choice("latents", DATA_KINDS, "data kind")`."""
    return _declared(default, Rule(choices=choices, noun=noun))


def checked(default: Any, check: Callable[[str, Any], None]) -> Any:
    """A field whose rule is defined where the value is used (e.g. the guidance scale's)."""
    return _declared(default, Rule(check=check))


@dataclass
class ModelConfig:
    name: str = choice("DiT-S/2", DIT_MODELS, "model")
    topology: str = choice("ancre", TOPOLOGIES, "topology")
    learn_sigma: bool = True
    class_dropout: float = ranged(0.1, ge=0, lt=1)
    # Overrides of the named size (small custom models); null = the named size's.
    depth: int | None = ranged(None, ge=1, hint="null = the named size's")
    hidden_size: int | None = ranged(None, ge=1, hint="null = the named size's")
    num_heads: int | None = ranged(None, ge=1, hint="null = the named size's")
    # The block's layers: the 2022 DiT by default; rmsnorm + swiglu + rope2d + qk_norm is LightningDiT's.
    norm: str = choice("layernorm", NORMS)
    mlp: str = choice("gelu", MLPS)
    pos_embed: str = choice("sincos", POS_EMBEDS)
    qk_norm: bool = False
    # Weight of the Tsallis-entropy (q = 2) penalty on ANCRe's incoming weights, added to the loss
    # to push toward sparse topologies (ancre_dit.models.topologies.analysis.tsallis_entropy); 0 = off.
    topology_entropy_weight: float = ranged(0.0, ge=0, hint="0 = off")
    # Topology options, set as `model.<option>=value` (model.tau, model.hc_streams, ...): the ones
    # given, plus the chosen topology's defaults once loaded. The registry declares them.
    topology_options: dict[str, Any] = field(default_factory=dict)


def topology_options_of(m: ModelConfig) -> dict[str, Any]:
    """The options the chosen topology is built with (checked by the topology's registry entry)."""
    return resolve_options(m.topology, m.topology_options)


@dataclass
class DataConfig:
    kind: str = choice("latents", DATA_KINDS, "data kind")
    path: str | None = None           # latent dir (latents) or ImageFolder root (images)
    image_size: int = ranged(256, ge=1)  # pixels of the decoded image
    num_workers: int = ranged(4, ge=0, hint="0 = load in the main process")
    vae: str | None = None            # local VAE folder for sample grids (latents; default: manifest's)
    in_memory: bool = False           # latents: load every shard into RAM once (batches are then an index_select)


@dataclass
class TrainConfig:
    global_batch_size: int = ranged(256, ge=1)
    max_steps: int = ranged(400_000, ge=1)
    lr: float = ranged(1.0e-4, gt=0)
    weight_decay: float = ranged(0.0, ge=0)
    adam_beta1: float = ranged(0.9, ge=0, lt=1)
    adam_beta2: float = ranged(0.999, ge=0, lt=1)
    warmup_steps: int = ranged(0, ge=0)
    # The routing parameters' own optimizer settings (each topology declares which of its parameters
    # route across depth): their lr is lr x topology_lr_mult (under Adam, tau acts as one more such
    # multiplier on the logits), they are held at their initial values for the first
    # topology_warmup_steps steps, and decay by topology_weight_decay (0: the logits never decay).
    topology_lr_mult: float = ranged(1.0, ge=0, hint="0 = routing held at its initial values")
    topology_warmup_steps: int = ranged(0, ge=0, hint="steps with the routing held at its initial values")
    topology_weight_decay: float = ranged(0.0, ge=0)
    grad_clip: float = ranged(0.0, ge=0, hint="max global grad norm; 0 = off")
    ema_decay: float = ranged(0.9999, ge=0, le=1)
    ema_warmup: bool = False          # ramp the decay up from 0 (timm's warmup), for short runs
    mixed_precision: str = choice("bf16", PRECISIONS)
    grad_accum: int = ranged(1, ge=1)
    ckpt_every: int = ranged(50_000, ge=1)
    keep_last: int = ranged(0, ge=0, hint="keep the newest N checkpoints; 0 = keep all")
    log_every: int = ranged(100, ge=1)
    # Depth diagnostics (forward inflation, backward decay, redundancy, routing) of a fixed batch
    # every log_every steps: logs/diagnostics.jsonl, TensorBoard, diagnostics.png.
    diagnostics: bool = True
    sample_every: int = ranged(10_000, ge=0, hint="EMA sample grid every N steps; 0 = never")
    num_sample_images: int = ranged(16, ge=0)
    cfg_scale_for_grids: float = checked(4.0, check_guidance_scale)
    sample_steps: int = ranged(50, ge=1)  # steps of the grid sampler (the objective's default one)
    # Evaluation (see EvalConfig) every N steps and at the end; 0 = never.
    eval_every: int = ranged(0, ge=0, hint="0 = no evaluation")
    seed: int = ranged(0, ge=0)
    # Non-finite loss / grad norm: skip the update, or stop the run; with skip, stop after more
    # than nonfinite_max_skips in a row.
    nonfinite: str = choice("skip", NONFINITE_POLICIES)
    nonfinite_max_skips: int = ranged(10, ge=0)
    compile: bool = False
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~1 more forward)
    tf32: bool = True


@dataclass
class EvalConfig:
    """What an evaluation measures (run every train.eval_every steps, and by `evaluate.py --run`).

    Samples come from the EMA weights with a fixed seed, sampler and step count, once per cfg scale.
    `metrics`: "digits" (held-out classifier accuracy + Fréchet distance on that classifier's
    features; NOT FID) and/or Inception metrics (fid, sfid, is, precision, recall) against `ref`;
    null = digits on digits data, fid when `ref` is set, else none (held-out loss only)."""
    num_samples: int = ranged(1000, ge=1)
    batch_size: int = ranged(250, ge=1)  # images per sampling part (part j goes to process j % world)
    # null: the objective's default sampler (DDPM: ddpm; flow: heun), and that sampler's default step count
    sampler: str | None = choice(None, ALL_SAMPLERS, "sampler")
    steps: int | None = ranged(None, ge=1, hint="null = the sampler's default")
    cfg_scales: list[float] = checked([1.0], check_guidance_scale)
    seed: int = ranged(0, ge=0)
    metrics: list[str] | None = choice(None, EVAL_METRICS, "metric")
    ref: str | None = None            # ADM reference npz, or one from evaluate.py --save-ref-stats
    inception_weights: str | None = None
    heldout_loss: bool = True         # loss on fixed held-out examples with fixed noise and times
    heldout_draws: int = ranged(4, ge=1)    # (noise, time) pairs per held-out example
    heldout_max: int = ranged(1000, ge=1)   # at most this many held-out examples (the first ones)
    val_path: str | None = None       # latents: a latent directory of held-out examples
    # latents: hold out the last N training samples (training skips them)
    heldout_from_train: int = ranged(0, ge=0, hint="0 = none")


@dataclass
class DiffusionConfig:
    objective: str = choice("ddpm", OBJECTIVES, "objective")  # ddpm (DiT) or flow (SiT's linear interpolant)
    time_sampling: str = choice("uniform", TIME_SAMPLINGS, "time sampling")  # flow: uniform (SiT) or logit-normal (SD3)
    logit_mean: float = 0.0           # logit-normal location
    logit_std: float = ranged(1.0, gt=0)  # logit-normal scale


@dataclass
class RepaConfig:
    """Representation alignment (REPA, training/repa.py): a frozen pretrained encoder's patch tokens of
    the clean image are matched, through a trained projector, by the DiT's state after block `depth`.
    Off at weight 0; the sampled model never holds the projector."""
    weight: float = ranged(0.0, ge=0, hint="0 = off; REPA's recipe uses 0.5")
    depth: int = ranged(8, ge=1, hint="the block whose output is aligned, 1..model depth")
    encoder: str = "vit_base_patch14_dinov2.lvd142m"  # a timm model name
    encoder_weights: str | None = None  # a local file of the encoder's weights (nothing is downloaded)
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments
    projector_dim: int = ranged(2048, ge=1)
    encoder_resolution: int | None = ranged(None, ge=1, hint="null = the DiT token grid x the encoder's patch size")


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
    repa: RepaConfig = field(default_factory=RepaConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


# -- reading: YAML file + overrides, merged by OmegaConf -------------------------------------------
def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """Reads the YAML at `path` (or the defaults when None), applies `a.b=value` overrides
    (values parsed as YAML) and validates everything that needs no data or processes."""
    layers = ([] if path is None else [_read_yaml(Path(path))]) + [_override(item) for item in overrides]
    option_layers = [_take_topology_options(layer) for layer in layers]
    for layer in layers:
        _normalize(Config, layer, "")
    config = _merge(Config, layers, "", OmegaConf.to_object)
    config.model.topology_options = _typed_topology_options(option_layers)
    validate_config(config)
    # Record the options the topology is built with, defaults included, so that config.yaml holds
    # them; in the registry's order, so that saving a loaded config writes the same bytes.
    options = {**config.model.topology_options, **topology_options_of(config.model)}
    config.model.topology_options = {key: options[key] for key in all_topology_options() if key in options}
    return config


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file {path} not found; pass --config configs/<name>.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a mapping with sections run_dir, model, data, train")
    return raw


def _override(item: str) -> dict:
    """`train.max_steps=20` -> {"train": {"max_steps": 20}} (the value parsed as YAML, else kept as text)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise UserError(f"override {item!r} is not key=value (e.g. train.max_steps=20)")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    for part in reversed(parts):
        value = {part: value}
    return value


def _take_topology_options(layer: dict) -> dict:
    """Removes the topology options from a layer's model section and returns them: `model.<option>`
    keys, and the `model.topology_options` mapping that config.yaml files held before options
    were written flat (old run folders must still resume and be evaluated)."""
    model = layer.get("model")
    if not isinstance(model, dict):
        return {}  # _normalize reports a model section that is not a mapping
    registered = all_topology_options()
    taken = model.pop("topology_options", None)
    taken = {} if taken is None else taken
    if not isinstance(taken, dict):
        raise UserError(f"config key model.topology_options must be a mapping of topology options, got {taken!r}")
    unknown = sorted(set(taken) - set(registered))
    if unknown:
        raise UserError(f"unknown topology option model.topology_options.{unknown[0]}; registered options: "
                        f"{', '.join(registered)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in [k for k in model if k in registered and k not in fields]:
        taken[key] = model.pop(key)
    return taken


def _typed_topology_options(option_layers: list[dict]) -> dict[str, Any]:
    """The options given, typed by their registry entries the way OmegaConf types the fields."""
    schema = dataclasses.make_dataclass("TopologyOptions", [
        (key, option.type | None if option.optional else option.type, field(default=MISSING))
        for key, option in all_topology_options().items()])
    for layer in option_layers:
        _normalize(schema, layer, "model.")
    given = _merge(schema, option_layers, "model.", OmegaConf.to_container)
    return {key: value for key, value in given.items() if value != MISSING}


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(T, optional) of an annotation T or T | None."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    if not args:
        return tp, False
    rest = [a for a in args if a is not type(None)]
    return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), len(rest) < len(args)


def _type_name(tp: Any) -> str:
    base, optional = _unwrap(tp)
    if typing.get_origin(base) is list:
        name = f"a list of {typing.get_args(base)[0].__name__}"
    elif base is dict or typing.get_origin(base) is dict:
        name = "a mapping"
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} or null" if optional else name


def _normalize(schema: type, values: dict, prefix: str) -> None:
    """Readies one layer (the file, or one override) for OmegaConf, in place, where OmegaConf alone
    would differ from what users rely on: a scalar where a list goes is a one-item list
    (eval.cfg_scales=1.5, eval.metrics=fid); YAML 1.1 reads an unquoted `no` as false, which is the
    string "no" where that is a choice (train.mixed_precision); a bool takes true or false only
    (OmegaConf reads 3 and "yes" as true) and a string takes neither (OmegaConf would store "False");
    a section takes a mapping and a plain value no mapping or list. Unknown keys are left to OmegaConf."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in values:
            continue
        key, value = prefix + f.name, values[f.name]
        tp, _ = _unwrap(hints[f.name])
        wrong = UserError(f"config key {key} must be {_type_name(hints[f.name])}, got {value!r}")
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise UserError(f"the {key} section must be a mapping of its keys ({key}: {{key: value, ...}}), "
                                f"got {value!r}")
            _normalize(tp, value, f"{key}.")
        elif value is None:
            continue  # OmegaConf says whether the field may be null
        elif typing.get_origin(tp) is list:
            items = value if isinstance(value, list) else [value]
            if isinstance(value, dict) or any(isinstance(item, (dict, list)) for item in items):
                raise wrong
            if not items:
                raise UserError(f"config key {key} must not be an empty list")
            values[f.name] = items
        elif tp is dict or typing.get_origin(tp) is dict:
            if not isinstance(value, dict):
                raise wrong
        elif isinstance(value, (dict, list)) or (tp is bool and not isinstance(value, bool)):
            raise wrong
        elif tp is str and isinstance(value, bool):
            rule = f.metadata.get(_RULE)
            if value is not False or rule is None or "no" not in rule.options():
                raise wrong
            values[f.name] = "no"


def _merge(schema: type, layers: list[dict], prefix: str, finish: Callable[[Any], Any]) -> Any:
    """`finish` (to_object or to_container) of the layers merged onto `schema` in order; OmegaConf's
    errors, and the TypeError / ValueError some of its merges raise, as one UserError."""
    try:
        return finish(OmegaConf.merge(OmegaConf.structured(schema), *layers))
    except Exception as err:  # noqa: BLE001  (only OmegaConf runs in here)
        raise _user_error(err, schema, layers, prefix) from None


def _user_error(err: Exception, schema: type, layers: list[dict], prefix: str) -> UserError:
    """One line naming the key and the fix, from what OmegaConf reports (the key at fault)."""
    path = re.sub(r"\[\d+\]", "", str(getattr(err, "full_key", None) or ""))
    parts = path.split(".") if path else []
    key = prefix + path
    owner: Any = schema
    for part in parts[:-1]:
        owner = typing.get_type_hints(owner).get(part) if dataclasses.is_dataclass(owner) else None
    if parts and dataclasses.is_dataclass(owner):
        names = [f.name for f in dataclasses.fields(owner)]
        if parts[-1] not in names:
            section = (prefix + ".".join(parts[:-1])).strip(".")
            options = (f"; or a topology option: {', '.join(all_topology_options())}"
                       if owner is ModelConfig and all_topology_options() else "")
            return UserError(f"unknown config key {key}; valid keys{f' of {section}' if section else ''}: "
                             f"{', '.join(names)}{options}")
        if isinstance(err, ValidationError):
            value = _given(layers, parts)
            return UserError(f"config key {key} must be {_type_name(typing.get_type_hints(owner)[parts[-1]])}, "
                             f"got {'null' if value is None else repr(value)}")
    problem = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return UserError(f"config key {key}: {problem}" if key else f"the config could not be read: {problem}")


def _given(layers: list[dict], parts: list[str]) -> Any:
    """The value the last layer that sets the key gives it."""
    for layer in reversed(layers):
        node: Any = layer
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return node
    return None


# -- checks ----------------------------------------------------------------------------------------
def validate_config(config: Config) -> None:
    """Checks that need neither the data nor the process group; one UserError for the first problem."""
    check_fields(config)
    _check_topology_options(config.model)
    _check_width_heads(config.model)
    _check_data_path(config.data)
    objective = _check_diffusion(config)
    _check_repa(config)
    _check_eval_data(config)
    _check_eval_sampling(config.eval, objective)
    _check_eval_metrics(config)


def check_fields(section: Any, prefix: str = "") -> None:
    """Every field's declared rule (range, choices or check), and every float finite: one out of
    range would train NaN or fail deep inside torch with a traceback."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{key}.")
            continue
        rule = f.metadata.get(_RULE)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise UserError(f"{key} must be a finite number, got {item}")
            if rule is not None and item is not None:
                rule(key, item)


def _check_topology_options(m: ModelConfig) -> None:
    """The ranges the registry declares (tau > 0, ...), then the chosen topology's own checks
    (e.g. frozen's topology_path)."""
    registered = all_topology_options()
    for key, value in m.topology_options.items():
        if key in registered:  # resolve_options names an unknown one
            registered[key].check(f"model.{key}", value)
    topology_options_of(m)


def _check_width_heads(m: ModelConfig) -> None:
    size = DIT_SIZES[DIT_MODELS[m.name][0]]  # (depth, width, heads) of the named size
    width, heads = m.hidden_size or size[1], m.num_heads or size[2]
    if width % heads:
        raise UserError(f"model.hidden_size={width} is not divisible by model.num_heads={heads}; change one of them")


def _check_data_path(d: DataConfig) -> None:
    if d.kind not in ("latents", "images"):
        return
    if not d.path:
        raise UserError(f"data.kind={d.kind} needs data.path (the {'latent directory' if d.kind == 'latents' else 'image folder'})")
    if not Path(d.path).is_dir():
        raise UserError(f"data path {d.path} does not exist; set data.path to the "
                        f"{'directory written by scripts/extract_latents.py' if d.kind == 'latents' else 'ImageFolder root (one folder per class)'}")


def diffusion_spec(config: Config) -> dict[str, Any]:
    """The diffusion section as the spec `ancre_dit.diffusion.build_objective` reads."""
    return {**dataclasses.asdict(config.diffusion), "learn_sigma": config.model.learn_sigma}


def _check_diffusion(config: Config) -> Objective:
    """The objective the run trains, built once here so that its own checks run now."""
    d = config.diffusion
    if d.objective != "flow" and d.time_sampling != "uniform":
        raise UserError(f"diffusion.time_sampling={d.time_sampling} applies only to diffusion.objective=flow "
                        "(DDPM draws integer timesteps uniformly)")
    return build_objective(diffusion_spec(config))


def _check_repa(config: Config) -> None:
    """REPA on: an encoder timm knows, its weights as a local file, a depth inside the model. (The
    token grids and the weights' fit to the encoder are checked when the trainer builds it.)"""
    r = config.repa
    if not r.weight:
        return
    import timm

    if not timm.is_model(r.encoder):
        raise UserError(f"repa.encoder {r.encoder!r} is not a timm model name; use e.g. "
                        f"vit_base_patch14_dinov2.lvd142m (DINOv2 ViT-B/14, REPA's choice)")
    blocks = config.model.depth or DIT_SIZES[DIT_MODELS[config.model.name][0]][0]
    if r.depth > blocks:
        raise UserError(f"repa.depth={r.depth} is beyond the {blocks} blocks of {config.model.name}; choose 1..{blocks} "
                        f"(REPA aligns block 8 of 12-block models)")
    for key in ("img_size", "num_classes", "pretrained"):
        if key in r.encoder_kwargs:
            raise UserError(f"repa.encoder_kwargs must not set {key}: the trainer sets it"
                            f"{' (use repa.encoder_resolution)' if key == 'img_size' else ''}")
    if not r.encoder_weights or not Path(r.encoder_weights).is_file():
        from .repa import weights_hint

        problem = (f"repa.encoder_weights {r.encoder_weights} does not exist" if r.encoder_weights
                   else f"repa.weight={r.weight:g} needs repa.encoder_weights")
        raise MissingFileError(f"{problem}; {weights_hint(r.encoder)}")


def _check_eval_data(config: Config) -> None:
    e = config.eval
    if (e.heldout_from_train or e.val_path) and config.data.kind != "latents":
        raise UserError("eval.val_path and eval.heldout_from_train apply to data.kind=latents only "
                        "(digits use their held-out split); remove them")
    if e.val_path and e.heldout_from_train:
        raise UserError("set eval.val_path or eval.heldout_from_train, not both")
    if e.val_path and not Path(e.val_path).is_dir():
        raise UserError(f"eval.val_path {e.val_path} does not exist; point it at a latent directory "
                        f"written by scripts/extract_latents.py")


def _check_eval_sampling(e: EvalConfig, objective: Objective) -> None:
    """eval.sampler must fit the objective and eval.steps its schedule (DDPM: at most its timesteps)."""
    sampler = e.sampler or objective.default_sampler
    if sampler not in objective.samplers:
        raise UserError(f"eval.sampler={sampler} does not fit diffusion.objective={objective.name}; "
                        f"choose {_or_list(objective.samplers)}")
    steps = objective.default_steps(sampler) if e.steps is None else e.steps
    try:
        objective.check_steps(sampler, steps)
    except UserError as err:  # worded for sample.py's flags
        raise UserError(str(err).replace("--steps", "eval.steps", 1)) from None


def _check_eval_metrics(config: Config) -> None:
    """What the metrics asked for need: digits data, or a reference and the Inception weights."""
    e, kind = config.eval, config.data.kind
    metrics = resolve_metrics(e, kind)
    if "digits" in metrics and kind != "digits":
        raise UserError(f"eval.metrics=digits scores 8x8 digits, but data.kind={kind}; use fid (with eval.ref)")
    inception = ", ".join(m for m in metrics if m in ADM_METRICS)
    if not inception:
        return
    if not e.ref:
        raise UserError(f"eval.metrics {inception} need eval.ref (an ADM reference npz or one written by "
                        f"evaluate.py --save-ref-stats)")
    if not Path(e.ref).exists():
        raise MissingFileError(f"eval.ref {e.ref} does not exist; pass an ADM reference npz or a file written by "
                               f"evaluate.py --save-ref-stats")
    if not e.inception_weights or not Path(e.inception_weights).is_file():
        problem = (f"eval.inception_weights {e.inception_weights} does not exist" if e.inception_weights
                   else "eval.inception_weights is not set")
        raise MissingFileError(f"{problem}; eval.metrics {inception} need {WEIGHTS_NAME} (torch-fidelity's port of "
                               f"TF's Inception; nothing is downloaded for you: fetch it from {WEIGHTS_URL}) and "
                               f"eval.inception_weights=weights/{WEIGHTS_NAME}")


def check_batch_layout(config: Config, num_processes: int) -> int:
    """Per-device micro-batch = global batch / (processes x accumulation); a UserError if it does not divide."""
    t = config.train
    parts = num_processes * t.grad_accum
    if t.global_batch_size % parts:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by {num_processes} "
                        f"process(es) x {t.grad_accum} accumulation step(s) = {parts}; choose a multiple of {parts}")
    return t.global_batch_size // parts


# -- writing ---------------------------------------------------------------------------------------
def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as config.yaml holds it: topology options flat in the model section, as they are given."""
    out = dataclasses.asdict(config)
    out["model"].update(out["model"].pop("topology_options"))
    return out


def save_config(config: Config, path: str | Path) -> None:
    """Writes config.yaml; load_config reads it back to an equal Config (and saving that gives the same bytes)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def flat_config(config: Config) -> dict[str, Any]:
    """{"train.lr": 1e-4, ...} with only bool/int/float/str values (what trackers accept)."""
    out: dict[str, Any] = {}
    for section, values in config_to_dict(config).items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            if isinstance(value, list):  # trackers take scalars only
                value = ",".join(str(v) for v in value)
            elif isinstance(value, dict):
                value = yaml.safe_dump(value, default_flow_style=True).strip()
            out[f"{section}.{key}" if key else section] = "null" if value is None else value
    return out
