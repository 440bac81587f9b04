"""Timestep, label and position embeddings of DiT (Peebles & Xie, 2023): timm has no adaLN-style
timestep embedder or class embedder with a null class for guidance; the sin-cos table follows MAE / DiT."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn


class TimestepEmbedder(nn.Module):
    """Embeds scalar diffusion timesteps with a sinusoidal code followed by a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
        """Sinusoidal code of (possibly fractional) timesteps t, shape (N,) -> (N, dim)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class-label embedding with an extra 'null' row (index num_classes): in training a fraction
    `dropout_prob` of labels becomes the null class, teaching the unconditional model guidance needs."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


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
