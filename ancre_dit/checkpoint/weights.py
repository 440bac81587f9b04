"""Readers of weight and metadata files that name a damaged file in one line (safetensors' and json's own
errors do not name it); every reader of a checkpoint goes through these."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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
