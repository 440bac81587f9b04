"""Typed training configuration: a YAML file + `section.key=value` overrides -> Config.

pydantic (config_sections.py) refuses unknown keys, wrong types and values out of range; its first
complaint becomes one UserError line naming the key. What a value means to the object that uses it
is checked by building that object (config_checks.validate_config). Both run inside load_config,
before anything is written. A topology's own options (model.tau, ...) are given flat in the model
section; the topology registry declares their types and defaults.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from ..errors import UserError, invalid_value
from ..files import load_yaml_unique, read_yaml_mapping, write_atomic
from ..models.topologies import all_topology_options
from .config_checks import validate_config
from .config_sections import Config, ModelConfig


def load_config(path: str | Path | None, overrides: Iterable[str] = (), check_paths: bool = True) -> Config:
    """The YAML at `path` (None: the defaults) with `a.b=value` overrides, checked; without
    `check_paths` the paths it names need not exist here (config_checks.validate_config)."""
    raw: dict = {} if path is None else read_yaml_mapping(
        Path(path), "config", "pass --config configs/<name>.yaml", "sections run_dir, model, data, train (see configs/)")
    for item in overrides:
        _merge_into(raw, _override(item))
    model = raw.get("model")
    options = _take_topology_options(model) if isinstance(model, dict) else {}
    try:
        config = Config(**raw)
    except ValidationError as err:
        raise _config_error(err) from None
    config.model.topology_options = options
    validate_config(config, check_paths)  # also records the topology's options, defaults included
    return config


def check_unique_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides, refused when one key is given twice (the last would win silently)."""
    seen: dict[str, str] = {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.strip()
        if sep and key in seen:
            raise UserError(f"{key} is given twice on the command line ({seen[key]} and {item}); give it once")
        seen[key] = item
    return list(overrides)


def _override(item: str) -> dict:
    """`train.max_steps=20` -> {"train": {"max_steps": 20}} (the value parsed as YAML, else kept as text)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise UserError(f"override {item!r} is not key=value (e.g. train.max_steps=20)")
    try:
        value = load_yaml_unique(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    for part in reversed(parts):
        value = {part: value}
    return value


def _merge_into(base: dict, layer: dict) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge_into(base[key], value)
        else:
            base[key] = value


def _take_topology_options(model: dict) -> dict:
    """Removes the topology options (`model.<option>` keys) from the model section and returns them."""
    if "topology_options" in model:  # the field load_config fills from the options given flat
        raise UserError("model.topology_options is not a config key; set each topology option as model.<option> "
                        "(e.g. model.tau=0.05)")
    fields = ModelConfig.__pydantic_fields__
    return {key: model.pop(key) for key in [k for k in model if k in all_topology_options() and k not in fields]}


def _config_error(err: ValidationError) -> UserError:
    """pydantic's first complaint as one line; an unknown key lists its section's keys."""
    first = err.errors()[0]
    loc = [str(part) for part in first["loc"] if not isinstance(part, int)]
    key = ".".join(loc)
    if first["type"] == "dataclass_type":
        return UserError(f"the {key} section must be a mapping of its keys ({key}: {{key: value, ...}}), "
                         f"got {first['input']!r}")
    if first["type"] == "unexpected_keyword_argument":
        owner: Any = Config
        for part in loc[:-1]:
            owner = owner.__pydantic_fields__[part].annotation
        extra = f"; or a topology option: {', '.join(all_topology_options())}" if owner is ModelConfig else ""
        return UserError(f"unknown config key {key}; valid keys{f' of {loc[-2]}' if len(loc) > 1 else ''}: "
                         f"{', '.join(owner.__pydantic_fields__)}{extra}")
    return invalid_value(err)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as config.yaml holds it: topology options flat in the model section, as they are given."""
    out = dataclasses.asdict(config)
    out["model"].update(out["model"].pop("topology_options"))
    return out


def save_config(config: Config, path: str | Path) -> None:
    """Writes config.yaml (read back by load_config to an equal Config), atomically, only when its bytes change."""
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
    for name, values in config_to_dict(config).items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            if isinstance(value, list):  # trackers take scalars only
                value = ",".join(str(v) for v in value)
            elif isinstance(value, dict):
                value = yaml.safe_dump(value, default_flow_style=True).strip()
            out[f"{name}.{key}" if key else name] = "null" if value is None else value
    return out
