"""A timm model's weights from a local file (nothing is downloaded), loaded strictly after timm's own
conversions: for REPA's encoder and the FD-DINOv2 feature extractor."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch.nn as nn

from ..errors import UserError


def weights_hint(encoder: str, flag: str = "repa.encoder_weights=PATH") -> str:
    """How to get an encoder's weights file, for the one-line errors (no network is assumed here)."""
    hub = None
    with contextlib.suppress(Exception):  # only the wording of a hint depends on it
        import timm
        hub = getattr(timm.models.get_pretrained_cfg(encoder), "hf_hub_id", None)
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
    key = "patch_embed.proj.weight"  # timm would resample another patch size's embedding; for REPA another encoder
    theirs, mine = state.get(key), own.get(key)
    mismatch = None
    if theirs is not None and mine is not None and theirs.ndim == 4 and theirs.shape[-2:] != mine.shape[-2:]:
        mismatch = (f"{key} is {tuple(theirs.shape)} in the file, {tuple(mine.shape)} in the encoder "
                    f"(another patch size)")
    convert = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if mismatch is None and convert is not None:
        try:
            state = convert(dict(state), model)
        except Exception as err:  # noqa: BLE001 - a foreign layout fails inside timm's conversion
            mismatch = f"timm could not convert it ({' '.join(str(err).split()) or type(err).__name__})"
    if mismatch is None:
        classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or "head"
        state = {k: v for k, v in state.items() if k in own or not k.startswith(f"{classifier}.")}  # headless encoder
        lacking = [f"the file lacks {k}" if k not in state else
                   f"{k} is {tuple(state[k].shape)} in the file, {tuple(v.shape)} in the encoder"
                   for k, v in own.items() if k not in state or tuple(state[k].shape) != tuple(v.shape)]
        extra = [f"the file holds {k}, which the encoder has no place for" for k in state if k not in own]
        mismatch = next(iter(lacking + extra), None)
    if mismatch is not None:
        raise UserError(f"{flag} {path} does not hold the weights of {name_flag} {name}: {mismatch}; "
                        f"point it at that encoder's weights, or set {name_flag} to the file's architecture")
    model.load_state_dict(state, strict=True)
