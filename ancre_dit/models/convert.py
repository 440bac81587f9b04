"""Importing checkpoints: the original DiT release and the official ANCRe code -> our keys,
and a load that names an architecture mismatch in one line instead of a wall of missing keys."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
from ..errors import UserError

_PREFIXES = ("module.", "_orig_mod.")


def convert_official_state_dict(checkpoint: Mapping[str, Any], prefer: str = "ema") -> dict[str, torch.Tensor]:
    """Maps a DiT or official-ANCRe state dict (or a {"model":..., "ema":...} training wrapper)
    to this package's parameter names.

    - `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes are stripped, in any order;
    - `ancre.shortcut_params.N` (block N+1's incoming logits) -> `topology.logits.N`;
    - `ancre.softmax_temp` -> `topology.tau`; every other DiT key is already ours.
    """
    if prefer in checkpoint and isinstance(checkpoint[prefer], Mapping):
        checkpoint = checkpoint[prefer]
    elif "model" in checkpoint and isinstance(checkpoint["model"], Mapping):
        checkpoint = checkpoint["model"]
    converted = {}
    for key, value in checkpoint.items():
        if not isinstance(value, torch.Tensor):
            continue
        stripped = True
        while stripped:
            stripped = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix):], True
        key = key.replace("ancre.shortcut_params.", "topology.logits.")
        key = key.replace("ancre.softmax_temp", "topology.tau")
        converted[key] = value
    return converted


def architecture_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a DiT state dict says about its architecture (model family, size, topology)."""
    def shape(key):
        return tuple(state_dict[key].shape) if key in state_dict else None

    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    proj = shape("x_embedder.proj.weight")  # (hidden, C, p, p)
    final = shape("final_layer.linear.weight")  # (p*p*out_channels, hidden)
    table = shape("y_embedder.embedding_table.weight")
    hidden = proj[0] if proj else None
    patch = proj[2] if proj else None
    topology_keys = sorted({k for k in state_dict if k.startswith("topology.")})
    return {
        "model": _model_name(depth, hidden, patch),
        "depth": depth,
        "hidden size": hidden,
        "patch size": patch,
        "input channels": proj[1] if proj else None,
        "output channels": final[0] // (patch * patch) if final and patch else None,
        "class table": table[0] if table else None,
        "tokens": shape("pos_embed")[1] if shape("pos_embed") else None,
        "topology": _topology_kind(state_dict, topology_keys),
    }


def _model_name(depth, hidden, patch) -> str:
    from .dit import DIT_SIZES
    for size, (d, h, _) in DIT_SIZES.items():
        if (d, h) == (depth, hidden):
            return f"DiT-{size}/{patch}"
    return f"DiT(depth={depth}, hidden={hidden}, patch={patch})"


def _topology_kind(state_dict, keys) -> str:
    if not keys:
        return "cascaded (no topology parameters)"
    shapes = ", ".join(f"{k}{list(state_dict[k].shape)}" for k in keys[:3])
    return f"{len(keys)} topology tensors ({shapes}{', ...' if len(keys) > 3 else ''})"


def load_state_dict_checked(model: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Loads strictly; if the architectures differ, raises one ValueError line naming how."""
    expected = model.state_dict()
    mismatch = [k for k in expected if k not in state_dict or tuple(state_dict[k].shape) != tuple(expected[k].shape)]
    mismatch += [k for k in state_dict if k not in expected]
    if mismatch:
        ours, theirs = architecture_of(expected), architecture_of(state_dict)
        diffs = [f"{field} {theirs[field]} vs {ours[field]}" for field in ours if ours[field] != theirs[field]]
        if not diffs:
            diffs = [f"parameter {mismatch[0]} differs"]
        raise UserError(
            f"{source} does not fit this model ({'; '.join(diffs)}; checkpoint vs model): "
            f"build the model with the settings the checkpoint was trained with"
        )
    model.load_state_dict(state_dict, strict=True)
