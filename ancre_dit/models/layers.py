"""A DiT block's layers by name, all timm's: DiT's by default, LightningDiT's as switches (RMSNorm, a
SwiGLU MLP, 2D rotary position embeddings, QK-norm)."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from timm.layers import Attention, AttentionRope, Mlp, PatchEmbed, RotaryEmbeddingCat, SwiGLU

from ..errors import UserError

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POS_EMBEDS = ("sincos", "rope2d", "sincos+rope2d")
DEFAULTS = {"norm": "layernorm", "mlp": "gelu", "pos_embed": "sincos", "qk_norm": False}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """An unknown layer name is one line, never a silent default."""
    if value not in choices:
        raise UserError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def make_norm(kind: str, dim: int) -> nn.Module:
    """The pre-norm of a branch (or of the final layer): no affine weights, adaLN supplies them."""
    check_choice("norm", kind, NORMS)
    return (nn.RMSNorm if kind == "rmsnorm" else nn.LayerNorm)(dim, eps=1e-6, elementwise_affine=False)


def swiglu_hidden(dim: int, mlp_ratio: float) -> int:
    """2/3 of the GELU MLP's width, so SwiGLU's three matrices hold as many weights (as LightningDiT)."""
    return int(2 * mlp_ratio * dim / 3)


def make_mlp(kind: str, dim: int, mlp_ratio: float) -> nn.Module:
    check_choice("mlp", kind, MLPS)
    if kind == "swiglu":
        return SwiGLU(in_features=dim, hidden_features=swiglu_hidden(dim, mlp_ratio), act_layer=nn.SiLU)
    return Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=partial(nn.GELU, approximate="tanh"),
               drop=0)


def make_attention(dim: int, num_heads: int, *, rope: bool, qk_norm: bool) -> nn.Module:
    """DiT's attention; with rope timm's variant rotating q and k (attn(x, rope=...)); qk_norm: RMSNorm."""
    if rope:
        return AttentionRope(dim=dim, num_heads=num_heads, qkv_bias=True, num_prefix_tokens=0, qk_norm=qk_norm,
                             norm_layer=nn.RMSNorm if qk_norm else None)
    return Attention(dim, num_heads=num_heads, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.RMSNorm)


def axial_rope(head_dim: int, grid: int) -> torch.Tensor:
    """2D rotary sin and cos tables (grid * grid, 2 * head_dim) for timm's AttentionRope (half the bands per axis)."""
    return RotaryEmbeddingCat(dim=head_dim, in_pixels=False, feat_shape=[grid, grid]).get_embed()
