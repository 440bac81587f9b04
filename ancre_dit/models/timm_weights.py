"""A timm model's weights from a local file (nothing is downloaded), loaded strictly after timm's own
conversions: for REPA's encoder and the FD-DINOv2 feature extractor."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import UserError


def weights_hint(encoder: str, flag: str = "repa.encoder_weights=PATH") -> str:
    """How to get an encoder's weights file, for the one-line errors (no network is assumed here)."""
    hub = None
    try:
        import timm
        hub = getattr(timm.models.get_pretrained_cfg(encoder), "hf_hub_id", None)
    except Exception:  # noqa: BLE001 - only the wording of a hint depends on it
        pass
    sources = [f"timm's copy: huggingface-cli download {hub} model.safetensors --local-dir weights/"] if hub else []
    if "dinov2" in encoder:
        sources.append("Meta's DINOv2 release, e.g. dinov2_vitb14_pretrain.pth for ViT-B/14")
    where = "; ".join(sources) or "the weights file of the encoder's release"
    return (f"nothing is downloaded for you: fetch the weights of {encoder} where there is network ({where}) "
            f"and set {flag}")


def load_timm_weights(model: nn.Module, path: str | Path, name: str, flag: str = "repa.encoder_weights",
                      name_flag: str = "repa.encoder") -> None:
    """Loads a local weights file into `model` strictly, else one line naming the first key that does not
    fit and the user's settings `flag` / `name_flag`."""
    from timm.models import load_state_dict

    try:
        state = load_state_dict(str(path))
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same one-line answer
        raise UserError(f"{flag} {path} is not a readable weights file "
                        f"({' '.join(str(err).split()) or type(err).__name__}); {weights_hint(name, f'{flag}=PATH')}"
                        ) from None
    own = model.state_dict()
    mismatch = _patch_mismatch(state, own)
    if mismatch is None:
        convert = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
        if convert is not None:
            try:
                state = convert(dict(state), model)
            except Exception as err:  # noqa: BLE001 - a foreign layout fails inside timm's conversion
                mismatch = f"timm could not convert it ({' '.join(str(err).split()) or type(err).__name__})"
    if mismatch is None:
        classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or "head"
        state = {k: v for k, v in state.items() if k in own or not k.startswith(f"{classifier}.")}  # headless encoder
        mismatch = _first_mismatch(state, own)
    if mismatch is not None:
        raise UserError(f"{flag} {path} does not hold the weights of {name_flag} {name}: {mismatch}; "
                        f"point it at that encoder's weights, or set {name_flag} to the file's architecture")
    model.load_state_dict(state, strict=True)


def _patch_mismatch(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str | None:
    """timm would resample a patch embedding of another patch size; for REPA that is another encoder."""
    key = "patch_embed.proj.weight"
    theirs, mine = state.get(key), own.get(key)
    if theirs is None or mine is None or theirs.ndim != 4 or theirs.shape[-2:] == mine.shape[-2:]:
        return None
    return f"{key} is {tuple(theirs.shape)} in the file, {tuple(mine.shape)} in the encoder (another patch size)"


def _first_mismatch(state: dict[str, Any], own: dict[str, torch.Tensor]) -> str | None:
    for key, value in own.items():
        if key not in state:
            return f"the file lacks {key}"
        if tuple(state[key].shape) != tuple(value.shape):
            return f"{key} is {tuple(state[key].shape)} in the file, {tuple(value.shape)} in the encoder"
    extra = [k for k in state if k not in own]
    return f"the file holds {extra[0]}, which the encoder has no place for" if extra else None
