"""What a checkpoint folder says about its model, so sample.py (or user code) rebuilds the exact network
without the training config or Accelerate. RUN/checkpoints/<step>/ holds, next to Accelerate's state,
model_spec.json ({"model": {"name", "kwargs"}, "diffusion", "data", "step"}), ema.safetensors (what sampling
uses by default) and model.safetensors (raw weights). Every reader of a checkpoint goes through the readers
here, which name a damaged file in one line (safetensors' and json's own errors do not name it).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..models import DiT, create_model, load_state_dict_checked
from ..models.topologies import restore_topology
from ..errors import MissingFileError, UserError


def damaged(path: Path, why: str) -> UserError:
    return UserError(f"{path} is damaged ({why}); it cannot be read: pick another checkpoint, "
                     f"or rewrite the file from its source")


def load_safetensors_checked(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """safetensors.torch.load_file, with a missing or unreadable file as a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} is missing; the checkpoint is incomplete, pick another step")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise damaged(path, " ".join(str(err).split())) from None


def save_safetensors(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """A state dict as a safetensors file (tensors detached, made contiguous, on the CPU)."""
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))


def read_json_checked(path: str | os.PathLike) -> Any:
    """json.loads of a file, with unreadable JSON as a UserError naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise damaged(path, f"not valid JSON: {err}") from None


SPEC_FILE = "model_spec.json"
WEIGHT_FILES = {"ema": "ema.safetensors", "model": "model.safetensors"}


def weights_file(name: str) -> str:
    """The file of a checkpoint's weights by name: ema, model, or another EMA (ema-<decay>, phema-<std>)."""
    if name not in WEIGHT_FILES and not name.startswith(("ema-", "phema-")):
        raise UserError(f"unknown weights {name!r}; choose ema or model (or an EMA such as ema-0.999)")
    return WEIGHT_FILES.get(name, f"{name}.safetensors")


# What the model sees of its data (the VAE's path and the data folder may move; these record their contents).
DATA_KEYS = ("kind", "image_size", "image_channels", "num_classes", "scaling_factor", "latent_norm",
             "channel_mean", "channel_std")


def data_differences(saved: dict[str, Any], wanted: dict[str, Any],
                     where: tuple[str, str] = ("in the checkpoint", "in the config")) -> list[str]:
    """'data.key A in the checkpoint, B in the config' for each DATA_KEYS entry two specs' "data" differ in
    (floats to 1e-6 relative: they went through JSON)."""
    saved, wanted = {"latent_norm": "scale", **saved}, {"latent_norm": "scale", **json.loads(json.dumps(wanted))}
    return [f"data.{key} {saved.get(key)} {where[0]}, {wanted.get(key)} {where[1]}"
            for key in DATA_KEYS if not _same_value(saved.get(key), wanted.get(key))]


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return math.isclose(a, b, rel_tol=1e-6) if numbers else a == b


def make_model_spec(name: str, model_kwargs: dict[str, Any], diffusion: dict[str, Any], data: dict[str, Any],
                    step: int) -> dict[str, Any]:
    """The spec of create_model(name, **model_kwargs) trained with the objective spec `diffusion` on `data`."""
    return {"model": {"name": name, "kwargs": dict(model_kwargs)}, "diffusion": dict(diffusion),
            "data": dict(data), "step": int(step)}


def write_model_files(folder: str | Path, spec: dict[str, Any], model_state: dict[str, torch.Tensor],
                      ema_state: dict[str, torch.Tensor] | None = None) -> None:
    """Writes the spec and the weights (safetensors; tensors made contiguous, on CPU)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SPEC_FILE).write_text(json.dumps(spec, indent=1))
    for kind, state in (("model", model_state), ("ema", ema_state)):
        if state is not None:
            save_safetensors(state, folder / WEIGHT_FILES[kind])


def load_model_spec(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / SPEC_FILE
    if not path.is_file():
        raise MissingFileError(f"{path.parent} is not a checkpoint folder ({SPEC_FILE} missing); pass "
                               f"RUN/checkpoints/<step> of a training run")
    spec = read_json_checked(path)
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict) or "kwargs" not in spec["model"]:
        raise UserError(f"{path} is damaged (no model name and kwargs); pick another checkpoint")
    return spec


def load_trained_model(folder: str | Path, weights: str = "ema", device: str | torch.device = "cpu"
                       ) -> tuple[DiT, dict]:
    """A checkpoint's network in eval mode with its `weights` (ema, model, ema-<decay>, phema-<std>)."""
    path = Path(folder) / weights_file(weights)
    spec = load_model_spec(folder)
    state = load_safetensors_checked(path)
    model = build_model(spec, state)
    load_state_dict_checked(model, state, source=str(path))
    return model.to(device).eval(), spec


def build_model(spec: dict[str, Any], state: Mapping[str, torch.Tensor] | None = None) -> DiT:
    """The network a spec describes, weights not loaded. A topology that carries its frozen weights rebuilds
    from `state` (its `topology.*` tensors suffice; the JSON it came from may be gone)."""
    kwargs = dict(spec["model"]["kwargs"])
    topology = None if state is None else restore_topology(kwargs.get("topology", "cascaded"), state, kwargs)
    if topology is not None:
        kwargs["topology"] = topology
    return create_model(spec["model"]["name"], **kwargs)
