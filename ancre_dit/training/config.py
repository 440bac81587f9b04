"""Typed training configuration: a YAML file + `section.key=value` overrides -> Config.

The dataclasses of config_schema.py are the schema (sections run_dir, model, data, train, diffusion,
repa, eval, log). OmegaConf merges the file and then each override onto them as structured configs,
so unknown keys and values of the wrong type are refused there; its errors come out as one
UserError line naming the key. Each field's range or choices is then checked where it is declared
(config_schema.check_fields), and what involves several fields or the file system by
config_checks.py. All of it runs inside load_config, before anything is written, so a bad setting
never leaves a half-made run folder behind.

A topology's own hyperparameters (model.tau, model.hc_streams, ...) are not fields: the topology
registry (models/topologies/registry.py) declares them with their types, defaults and ranges,
ModelConfig.topology_options holds them, and config.yaml holds them flat as model.<option>.
"""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError

from ..errors import UserError
from ..files import DuplicateKeyError, load_yaml_unique, write_atomic
from ..models.topologies import all_topology_options
from .config_checks import validate_config
from .config_schema import RULE_KEY, Config, ModelConfig


# -- reading: YAML file + overrides, merged by OmegaConf -------------------------------------------
def load_config(path: str | Path | None, overrides: Iterable[str] = (), check_paths: bool = True) -> Config:
    """Reads the YAML at `path` (or the defaults when None), applies `a.b=value` overrides
    (values parsed as YAML) and validates everything that needs no data or processes; without
    `check_paths`, the paths it names need not exist here (config_checks.validate_config)."""
    layers = ([] if path is None else [_read_yaml(Path(path))]) + [_override(item) for item in overrides]
    option_layers = [_take_topology_options(layer) for layer in layers]
    for layer in layers:
        _normalize(Config, layer, "")
    config = _merge(Config, layers, "", OmegaConf.to_object)
    config.model.topology_options = _typed_topology_options(option_layers)
    validate_config(config, check_paths)  # also records the topology's options, defaults included
    return config


def check_unique_overrides(overrides: Iterable[str]) -> list[str]:
    """The command line's overrides, refused when one key is given twice: it would say two things and
    the last would win silently (a key twice in a YAML file is refused the same way)."""
    seen: dict[str, str] = {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.strip()
        if sep and key in seen:
            raise UserError(f"{key} is given twice on the command line ({seen[key]} and {item}); give it once")
        seen[key] = item
    return list(overrides)


def read_yaml_mapping(path: Path, kind: str, fix_missing: str, contents: str) -> dict:
    """A YAML file users write by hand (a training config, a study) as a mapping: a missing, empty or
    non-YAML file, a key given twice in one mapping (PyYAML would keep the last silently) or anything
    but a mapping is one UserError naming the file (`kind` file ... ; `contents`: what it must hold)."""
    if not path.is_file():
        raise UserError(f"{kind} file {path} not found; {fix_missing}")
    try:
        raw = load_yaml_unique(path.read_text())
    except DuplicateKeyError as err:
        raise UserError(f"{path}: {err} (PyYAML would keep only the last)") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file; pass a YAML {kind} file") from None
    if raw is None:
        raise UserError(f"{kind} file {path} is empty; give it {contents}")
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a mapping with {contents}")
    return raw


def _read_yaml(path: Path) -> dict:
    return read_yaml_mapping(path, "config", "pass --config configs/<name>.yaml",
                             "sections run_dir, model, data, train (see configs/)")


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
    """Removes the topology options (`model.<option>` keys) from a layer's model section and returns them."""
    model = layer.get("model")
    if not isinstance(model, dict):
        return {}  # _normalize reports a model section that is not a mapping
    if "topology_options" in model:  # the field load_config fills from the options given flat
        raise UserError("model.topology_options is not a config key; set each topology option as model.<option> "
                        "(e.g. model.tau=0.05)")
    registered = all_topology_options()
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return {key: model.pop(key) for key in [k for k in model if k in registered and k not in fields]}


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
            rule = f.metadata.get(RULE_KEY)
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


# -- writing ---------------------------------------------------------------------------------------
def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as config.yaml holds it: topology options flat in the model section, as they are given."""
    out = dataclasses.asdict(config)
    out["model"].update(out["model"].pop("topology_options"))
    return out


def save_config(config: Config, path: str | Path) -> None:
    """Writes config.yaml; load_config reads it back to an equal Config (and saving that gives the same
    bytes). Only when its bytes change, and atomically: a full disk never leaves a cut file behind."""
    path = Path(path)
    data = yaml.safe_dump(config_to_dict(config), sort_keys=False).encode()
    try:
        if path.is_file() and path.read_bytes() == data:
            return
        write_atomic(path, data)
    except OSError as err:
        path.with_name(f"{path.name}.tmp{os.getpid()}").unlink(missing_ok=True)
        raise UserError(f"cannot write {path} ({err.strerror or err}); free space or make the folder writable") from None


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
