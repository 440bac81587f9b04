"""Other codes' state dicts -> our keys, and a load that names an architecture mismatch in one line."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from ..errors import UserError
from .dit import DIT_SIZES, TimestepEmbedder

_PREFIXES = ("module.", "_orig_mod.")
_LOGITS, _TAU = "topology.logits", "topology.tau"


def convert_official_state_dict(checkpoint: Mapping[str, Any], prefer: str = "ema") -> dict[str, torch.Tensor]:
    """A DiT or official-ANCRe state dict (or a {"model":..., "ema":...} wrapper) under our names: `module.`
    and `_orig_mod.` stripped, `ancre.shortcut_params.N` -> `topology.logits.N`, `ancre.softmax_temp` ->
    `topology.tau`. Logits per target (block j+1's over sources 0..j, ours) stay; per source (source i's
    edges to blocks i+1..K) are remapped as `logits.j[i] = shortcut_params.i[j - i]`."""
    converted = _renamed(checkpoint, prefer)
    if official_logit_layout(converted) == "per-source":  # (renaming our own names changes nothing)
        K = converted[f"{_LOGITS}.0"].numel()  # source 0 has an edge to every block
        source = {i: converted.pop(f"{_LOGITS}.{i}") for i in range(K)}
        converted.update({f"{_LOGITS}.{j}": torch.stack([source[i][j - i] for i in range(j + 1)]) for j in range(K)})
    return converted


def _renamed(checkpoint: Mapping[str, Any], prefer: str) -> dict[str, torch.Tensor]:
    """The chosen state dict's tensors under our key names (logits still in the file's layout)."""
    if prefer in checkpoint and isinstance(checkpoint[prefer], Mapping):
        checkpoint = checkpoint[prefer]
    elif "model" in checkpoint and isinstance(checkpoint["model"], Mapping):
        checkpoint = checkpoint["model"]
    converted = {}
    for key, value in checkpoint.items():
        if not isinstance(value, torch.Tensor):
            continue
        while key.startswith(_PREFIXES):  # in any order
            key = key.split(".", 1)[1]
        converted[key.replace("ancre.shortcut_params.", f"{_LOGITS}.").replace("ancre.softmax_temp", _TAU)] = value
    return converted


def official_logit_layout(checkpoint: Mapping[str, Any], prefer: str = "ema") -> str | None:
    """An official checkpoint's ANCRe logits: "per-target" (lengths 1..K), "per-source" (K..1) or None."""
    found = {int(k.rsplit(".", 1)[1]): v.numel() for k, v in _renamed(checkpoint, prefer).items()
             if k.startswith(f"{_LOGITS}.") and k.rsplit(".", 1)[1].isdigit()}
    K = len(found)
    if sorted(found) != list(range(K)):
        raise UserError(f"the ANCRe logits are numbered {sorted(found)}, not 0..{K - 1}; the file is incomplete")
    if K == 0:
        return None
    lengths = [found[n] for n in range(K)]
    if lengths == list(range(1, K + 1)):
        return "per-target"
    if lengths == list(range(K, 0, -1)):
        return "per-source"
    raise UserError(f"the ANCRe logit vectors have lengths {lengths}: neither per target block (1, 2, ..., {K}) "
                    f"nor per source ({K}, ..., 1); this is not an ANCRe checkpoint layout we know")


def architecture_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a DiT state dict says about its architecture (model family, size, topology)."""
    def shape(key):
        return tuple(state_dict[key].shape) if key in state_dict else None

    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    proj = shape("x_embedder.proj.weight")  # (hidden, C, p, p)
    final = shape("final_layer.linear.weight")  # (p*p*out_channels, hidden)
    table = shape("y_embedder.embedding_table.weight")
    hidden, patch = (proj[0], proj[2]) if proj else (None, None)
    topology_keys = sorted(k for k in state_dict if k.startswith("topology."))
    shapes = ", ".join(f"{k}{list(state_dict[k].shape)}" for k in topology_keys[:3])
    sizes = [size for size, (d, h, _) in DIT_SIZES.items() if (d, h) == (depth, hidden)]
    return {"model": f"DiT-{sizes[0]}/{patch}" if sizes else f"DiT(depth={depth}, hidden={hidden}, patch={patch})",
            "depth": depth, "hidden size": hidden, "patch size": patch, "input channels": proj[1] if proj else None,
            "output channels": final[0] // (patch * patch) if final and patch else None,
            "class table": table[0] if table else None,
            "tokens": shape("pos_embed")[1] if shape("pos_embed") else None,
            "topology": (f"{len(topology_keys)} topology tensors ({shapes}{', ...' if len(topology_keys) > 3 else ''})"
                         if topology_keys else "cascaded (no topology parameters)")}


def load_state_dict_checked(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                            source: str = "checkpoint") -> None:
    """Loads strictly; if the architectures differ, raises one ValueError line naming how."""
    expected = model.state_dict()
    mismatch = [k for k in expected if k not in state_dict or tuple(state_dict[k].shape) != tuple(expected[k].shape)]
    mismatch += [k for k in state_dict if k not in expected]
    if mismatch:
        ours, theirs = architecture_of(expected), architecture_of(state_dict)
        diffs = ([f"{field} {theirs[field]} vs {ours[field]}" for field in ours if ours[field] != theirs[field]]
                 or [f"parameter {mismatch[0]} differs"])
        raise UserError(f"{source} does not fit this model ({'; '.join(diffs)}; checkpoint vs model): "
                        f"build the model with the settings the checkpoint was trained with")
    model.load_state_dict(state_dict, strict=True)


def reverse_time_axis(state: dict[str, torch.Tensor]) -> None:
    """Turns a DiT on t' = 1 - t with output -v (REPA: t' = 1 noise) into one on t with output v (SiT: t = 1
    data), in place, exact up to rounding. The sinusoidal code of 1 - t is a fixed linear map of t's (cos
    f(1-t) = cos f cos ft + sin f sin ft, ...), folded into the timestep MLP's first matrix; the sign goes
    into the final linear layer."""
    first = state["t_embedder.mlp.0.weight"]
    half = first.shape[1] // 2
    code_at_one = TimestepEmbedder.timestep_embedding(torch.ones(1, dtype=torch.float64), 2 * half)[0].double()
    cos, sin = code_at_one[:half], code_at_one[half:2 * half]
    w = first.double()
    folded = w.clone()
    folded[:, :half] = w[:, :half] * cos + w[:, half:2 * half] * sin
    folded[:, half:2 * half] = w[:, :half] * sin - w[:, half:2 * half] * cos
    state["t_embedder.mlp.0.weight"] = folded.to(first.dtype)
    for key in ("final_layer.linear.weight", "final_layer.linear.bias"):
        state[key] = -state[key]


def lightningdit_to_ours(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LightningDiT's state dict (hustvl/LightningDiT models/lightningdit.py) -> ours, exactly, and the block
    options read off its keys. Its RMSNorm weight w folds into adaLN's scale rows (x_hat w (1 + scale) +
    shift = x_hat (1 + scale') + shift, scale' = w scale + w - 1, linear in the condition). SwiGLU `w12` is
    timm's fc1_g and fc1_x, `w3` fc2; wo_shift blocks get zero shift rows; RoPE tables are rebuilt."""
    if any(k.endswith("q_norm.bias") for k in state):
        raise UserError("the file's QK-norm is a LayerNorm (LightningDiT with use_qknorm and without use_rmsnorm), "
                        "which our QK-norm (RMSNorm) does not reproduce; it cannot be imported")
    hidden = state["x_embedder.proj.weight"].shape[0]
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("feat_rope.") or key.endswith(("norm1.weight", "norm2.weight", "norm_final.weight")):
            continue
        if ".mlp.w12." in key:
            out[key.replace(".w12.", ".fc1_g.")], out[key.replace(".w12.", ".fc1_x.")] = value.chunk(2)
        else:
            out[key.replace(".mlp.w3.", ".mlp.fc2.")] = value

    def fold(prefix: str, scale_chunk: int, weight: torch.Tensor | None) -> None:
        if weight is None:
            return
        rows = slice(scale_chunk * hidden, (scale_chunk + 1) * hidden)
        w, b = out[f"{prefix}.weight"].clone(), out[f"{prefix}.bias"].clone()
        b[rows] = weight * b[rows] + weight - 1
        w[rows] = weight[:, None] * w[rows]
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = w, b

    for j in sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")}):
        prefix = f"blocks.{j}.adaLN_modulation.1"
        if out[f"{prefix}.weight"].shape[0] == 4 * hidden:  # wo_shift: scale, gate, scale, gate
            for part in ("weight", "bias"):
                scale_msa, gate_msa, scale_mlp, gate_mlp = out[f"{prefix}.{part}"].chunk(4)
                zero = torch.zeros_like(scale_msa)
                out[f"{prefix}.{part}"] = torch.cat([zero, scale_msa, gate_msa, zero, scale_mlp, gate_mlp])
        fold(prefix, 1, state.get(f"blocks.{j}.norm1.weight"))
        fold(prefix, 4, state.get(f"blocks.{j}.norm2.weight"))
    fold("final_layer.adaLN_modulation.1", 1, state.get("final_layer.norm_final.weight"))
    block = {"norm": "rmsnorm" if "blocks.0.norm1.weight" in state else "layernorm",
             "mlp": "swiglu" if "blocks.0.mlp.w12.weight" in state else "gelu",
             "pos_embed": "sincos+rope2d" if "feat_rope.freqs_cos" in state else "sincos",
             "qk_norm": "blocks.0.attn.q_norm.weight" in state}
    return out, block
