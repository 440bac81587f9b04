"""The layers a DiT block is built from, by name: the 2022 DiT block by default, the LightningDiT
choices as switches (RMSNorm, a SwiGLU MLP, 2D rotary position embeddings, QK-norm).

The 2022 DiT block's layers (`PatchEmbed`, `Attention`, `Mlp`) are written here, with timm's
parameter names, construction order and arithmetic (tests/test_layers.py holds them to timm's):
importing timm imports torchvision and with it torch's compiler, seconds in every process that
trains, samples or evaluates. The LightningDiT switches take timm's `SwiGLU`, `AttentionRope` and
`RotaryEmbeddingCat`, imported when chosen; what is ours there is the choice and the parameter rule
of the SwiGLU MLP.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POS_EMBEDS = ("sincos", "rope2d")
DEFAULTS = {"norm": "layernorm", "mlp": "gelu", "pos_embed": "sincos", "qk_norm": False}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """An unknown layer name is one line, never a silent default."""
    if value not in choices:
        raise UserError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def make_norm(kind: str, dim: int) -> nn.Module:
    """The pre-norm of a branch (or of the final layer): no affine weights, adaLN supplies them."""
    check_choice("norm", kind, NORMS)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    return nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


def swiglu_hidden(dim: int, mlp_ratio: float) -> int:
    """SwiGLU's hidden width: 2/3 of the GELU MLP's, so its three matrices (3 d h) hold as many
    weights as the GELU MLP's two (2 d * ratio d), as LightningDiT does."""
    return int(2 * mlp_ratio * dim / 3)


class PatchEmbed(nn.Module):
    """Non-overlapping patches to tokens: (N, C, H, W) -> (N, H/p * W/p, D), a strided convolution
    (parameter `proj`, as timm's and DiT's). The tokens are a transposed view of the convolution's
    output, as timm returns them."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with one qkv projection (parameters `qkv`, `proj`), through
    PyTorch's fused scaled_dot_product_attention; `qk_norm` RMS-normalises q and k per head
    (parameters `q_norm`, `k_norm`)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(x.transpose(1, 2).reshape(n, tokens, dim))


class Mlp(nn.Module):
    """fc1, the tanh-approximated GELU, fc2 (DiT's MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_mlp(kind: str, dim: int, mlp_ratio: float) -> nn.Module:
    check_choice("mlp", kind, MLPS)
    if kind == "swiglu":
        from timm.layers import SwiGLU
        return SwiGLU(in_features=dim, hidden_features=swiglu_hidden(dim, mlp_ratio), act_layer=nn.SiLU)
    return Mlp(dim, int(dim * mlp_ratio))


def make_attention(dim: int, num_heads: int, *, rope: bool, qk_norm: bool) -> nn.Module:
    """DiT's attention; with rope, timm's variant that rotates q and k (called as attn(x, rope=...));
    qk_norm RMS-normalises q and k per head."""
    if rope:
        from timm.layers import AttentionRope
        return AttentionRope(dim=dim, num_heads=num_heads, qkv_bias=True, num_prefix_tokens=0, qk_norm=qk_norm,
                             norm_layer=nn.RMSNorm if qk_norm else None)
    return Attention(dim, num_heads, qk_norm=qk_norm)


def axial_rope(head_dim: int, grid: int) -> torch.Tensor:
    """2D rotary embedding of a grid x grid token grid (half the bands per axis, integer positions):
    (grid * grid, 2 * head_dim), the sin and cos tables timm's AttentionRope applies to q and k."""
    from timm.layers import RotaryEmbeddingCat
    rope = RotaryEmbeddingCat(dim=head_dim, in_pixels=False, feat_shape=[grid, grid])
    return rope.get_embed()
