"""Diffusion Transformer (Peebles & Xie, 2023) with a pluggable residual topology.

Parameter names match the DiT release, so its checkpoints load; the one new module, `topology`, owns
the loop over blocks. The block's layers (layers.py) default to DiT's; the switches give LightningDiT's.
The embeddings are DiT's own: timm has no adaLN-style timestep embedder or class embedder with a null
class for guidance; the sin-cos table follows MAE / DiT.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import torch
import torch.nn as nn
from einops import rearrange

from ..errors import UserError
from .layers import DEFAULTS, POS_EMBEDS, PatchEmbed, axial_rope, check_choice, make_attention, make_mlp, make_norm
from .topologies import ResidualTopology, build_topology, configure_aggregation


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """Embeds scalar diffusion timesteps with a sinusoidal code followed by a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
        """Sinusoidal code of (possibly fractional) timesteps t, shape (N,) -> (N, dim), dim even."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class-label embedding with an extra 'null' row (index num_classes): in training a fraction
    `dropout_prob` of labels becomes the null class, teaching the unconditional model guidance needs."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0  # the null class's row, for classifier-free guidance
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor, train: bool) -> torch.Tensor:
        if train and self.dropout_prob > 0:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop_ids, self.num_classes, labels)
        return self.embedding_table(labels)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning. `block(x, c)` applies both residual adds, as in
    DiT; the branches are exposed so sublayer-level topologies (HC, mHC, DAR) can wire them themselves."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, norm: str = DEFAULTS["norm"],
                 mlp: str = DEFAULTS["mlp"], qk_norm: bool = DEFAULTS["qk_norm"], rope: torch.Tensor | None = None):
        super().__init__()
        self.norm1 = make_norm(norm, hidden_size)
        self.attn = make_attention(hidden_size, num_heads, rope=rope is not None, qk_norm=qk_norm)
        self.norm2 = make_norm(norm, hidden_size)
        self.mlp = make_mlp(mlp, hidden_size, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))
        self.register_buffer("rope", rope, persistent=False)  # a fixed table, rebuilt from the options (or None)

    def modulation(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift, scale, gate) of the attention branch, then of the MLP branch."""
        return self.adaLN_modulation(c).chunk(6, dim=1)

    def attention_branch(self, x, shift, scale, gate) -> torch.Tensor:
        h = modulate(self.norm1(x), shift, scale)
        return gate.unsqueeze(1) * (self.attn(h) if self.rope is None else self.attn(h, rope=self.rope))

    def mlp_branch(self, x, shift, scale, gate) -> torch.Tensor:
        return gate.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift, scale))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        mod = self.modulation(c)
        x = x + self.attention_branch(x, *mod[:3])
        return x + self.mlp_branch(x, *mod[3:])


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a linear map back to patch pixels."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, norm: str = DEFAULTS["norm"]):
        super().__init__()
        self.norm_final = make_norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Class-conditional diffusion backbone: patchify, K adaLN-Zero blocks wired by `topology`,
    unpatchify. Returns C channels (epsilon) or 2C (epsilon and the variance interpolation)."""

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True, topology: str | ResidualTopology = "cascaded",
                 norm: str = DEFAULTS["norm"], mlp: str = DEFAULTS["mlp"], pos_embed: str = DEFAULTS["pos_embed"],
                 qk_norm: bool = DEFAULTS["qk_norm"], history_dtype: str = "float32", topology_topk: int = 0,
                 aggregation_kernel: str = "torch", **topology_options):
        """`topology`: a registered name or a built module, `topology_options` its options (e.g. tau=0.01).
        `pos_embed` rope2d puts axial 2D RoPE on q and k and leaves the absolute embedding zero;
        `history_dtype`, `topology_topk` (0 = dense) and `aggregation_kernel` tune the aggregation."""
        super().__init__()
        check_choice("pos_embed", pos_embed, POS_EMBEDS)  # norm and mlp are checked where their layers are built
        if input_size % patch_size:
            raise UserError(f"input size {input_size} is not divisible by patch size {patch_size}; "
                            f"choose a model whose patch size divides it, or resize the data")
        if hidden_size % num_heads:
            raise UserError(f"hidden size {hidden_size} is not divisible by {num_heads} heads")
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.input_size = input_size
        self.num_classes = num_classes

        self.x_embedder = PatchEmbed(img_size=input_size, patch_size=patch_size, in_chans=in_channels,
                                     embed_dim=hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # Fixed sin-cos embedding, a frozen parameter as in DiT so its checkpoints load unchanged.
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.pos_embed_kind = pos_embed
        rope = axial_rope(hidden_size // num_heads, input_size // patch_size) if "rope2d" in pos_embed else None
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio, norm=norm, mlp=mlp,
                                              qk_norm=qk_norm, rope=rope) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm=norm)
        # On a fork of the random state, registered last: the backbone's weights are the same whatever
        # the topology draws, so runs that differ only in topology start from one network (paired seeds).
        with torch.random.fork_rng(devices=[]):
            self.topology = (topology if isinstance(topology, ResidualTopology)
                             else build_topology(topology, depth, hidden_size, **topology_options))
            configure_aggregation(self.topology, history_dtype, topology_topk, aggregation_kernel)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's initialisation: xavier linears, zeroed adaLN and output layers (adaLN-Zero)."""
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
        for name, child in self.named_children():  # a topology initialises its own layers
            if name != "topology":
                child.apply(_basic_init)

        if "sincos" in self.pos_embed_kind:  # with rope2d alone the positions enter through q and k: it stays zero
            pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], int(self.x_embedder.num_patches ** 0.5))
            self.pos_embed.data.copy_(torch.from_numpy(pos_embed).float().unsqueeze(0))

        # Patch embedding like nn.Linear (instead of nn.Conv2d's default).
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)

        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)

        for layer in [*(block.adaLN_modulation[-1] for block in self.blocks), self.final_layer.adaLN_modulation[-1],
                      self.final_layer.linear]:  # adaLN-Zero
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing per block (the unit the topology wires); gradients are unchanged."""
        self.topology.grad_checkpointing = bool(enable)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, p*p*C) -> (N, C, H, W)."""
        p = self.patch_size
        return rearrange(x, "n (h w) (p q c) -> n c (h p) (w q)", h=int(x.shape[1] ** 0.5), p=p, q=p)

    def embed(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens h_0, the conditioning vector c = t-embedding + y-embedding, and the t-embedding alone."""
        # Contiguous: else every residual add keeps PatchEmbed's transposed layout and each history flattening copies.
        h0 = (self.x_embedder(x) + self.pos_embed).contiguous()
        t_emb = self.t_embedder(t)
        return h0, t_emb + self.y_embedder(y, self.training), t_emb

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (N, C, H, W) noisy input, t (N,) timesteps, y (N,) labels (num_classes = null)."""
        h0, c, t_emb = self.embed(x, t, y)
        time_embedding = (t_emb,) if self.topology.takes_time_embedding else ()  # timestep-aware routing (DAR)
        return self.unpatchify(self.final_layer(self.topology(h0, self.blocks, c, *time_embedding), c))

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         guided_channels: int | None = None) -> torch.Tensor:
        """Classifier-free guidance in one forward: labels in the first half of the batch, the null label in
        the second, the guided epsilon in both. `guided_channels=3` is DiT's (it guides 3 channels only)."""
        half = x[: len(x) // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        g = self.in_channels if guided_channels is None else guided_channels
        cond_eps, uncond_eps = torch.split(out[:, :g], len(out) // 2, dim=0)
        guided = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([guided, guided], dim=0), out[:, g:]], dim=1)  # (the rest unguided)


# A model spec records an architecture choice only where it differs from these (older specs stay the same).
ARCHITECTURE_DEFAULTS = {key: parameter.default for key, parameter in inspect.signature(DiT).parameters.items()
                         if key in ("norm", "mlp", "pos_embed", "qk_norm", "history_dtype", "topology_topk",
                                    "aggregation_kernel")}

# name -> (depth, hidden_size, num_heads) as in the DiT paper; "T" is ours, a tiny CPU model.
DIT_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16), "T": (12, 192, 3)}
DIT_MODELS = {f"DiT-{size}/{patch}": (size, patch) for size in DIT_SIZES for patch in (1, 2, 4, 8)
              if size == "T" or patch != 1}


def model_size(name: str) -> dict[str, int]:
    """A registered name's depth, hidden_size, num_heads and patch_size."""
    if name not in DIT_MODELS:
        raise UserError(f"unknown model {name!r}; choose one of {', '.join(DIT_MODELS)}")
    size, patch = DIT_MODELS[name]
    depth, hidden_size, num_heads = DIT_SIZES[size]
    return {"depth": depth, "hidden_size": hidden_size, "num_heads": num_heads, "patch_size": patch}


def create_model(name: str, **kwargs) -> DiT:
    """Builds a registered DiT, e.g. create_model("DiT-S/2", topology="ancre", tau=0.01); any DiT
    constructor argument can be given (depth, hidden_size and num_heads override the size)."""
    return DiT(**{**model_size(name), **kwargs})


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: int) -> np.ndarray:
    """Fixed 2-D sin-cos position table of shape (grid_size**2, embed_dim): half the channels
    encode the column, half the row (each half its sines, then its cosines)."""
    half = embed_dim // 2
    if half % 2:
        raise ValueError(f"sin-cos position embedding needs an even width, got {half}")
    omega = 1.0 / 10000 ** (np.arange(half // 2, dtype=np.float64) / (half / 2.0))
    positions = np.arange(grid_size, dtype=np.float32)
    tables = []
    for grid in np.meshgrid(positions, positions):  # the column (varying fastest), then the row, as in DiT / MAE
        out = np.einsum("m,d->md", grid.reshape(-1).astype(np.float64), omega)
        tables += [np.sin(out), np.cos(out)]
    return np.concatenate(tables, axis=1)
