"""Learned-topology heatmaps: one matrix, several on one colour scale, or an animation. P is (K, K):
row j = block j+1's weights over sources i = 0..j (0 = the embedding), as `probabilities()` returns it."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Mapping

import numpy as np

from ..models.topologies.analysis import square_topology
from .canvas import save_figure, subplots


def _draw_topology(ax, P: np.ndarray, vmax: float, title: str | None, dense: int = 12, spacing: int = 6,
                   **tick_style):
    """P below its diagonal; a tick per block up to `dense` blocks, else every K // spacing blocks."""
    masked = np.ma.masked_where(np.triu(np.ones_like(P, dtype=bool), k=1), P)
    image = ax.imshow(masked, cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    K = P.shape[0]
    step = 1 if K <= dense else max(1, K // spacing)
    ax.set_xticks(np.arange(K)[::step], [str(i) for i in range(K)][::step], **tick_style)
    ax.set_yticks(np.arange(K)[::step], [str(j + 1) for j in range(K)][::step], **tick_style)
    if title is not None:
        ax.set_title("\n".join(textwrap.wrap(title, 22)), fontsize=8)  # long run names wrap instead of overlapping
    return image


def plot_topology_heatmap(P, path: str | Path, title: str | None = None) -> Path:
    """Lower-triangular heatmap of P, cells annotated with their weight when K <= 16."""
    P = square_topology(P, min_blocks=1)
    K = P.shape[0]
    size = max(4.0, 0.45 * K + 2.0)
    fig, ax = subplots(figsize=(size + 1.0, size))
    image = _draw_topology(ax, P, max(1e-12, float(np.nanmax(P))), None, dense=16, spacing=12)
    fig.colorbar(image, ax=ax, label="p_ij")
    ax.set(xlabel="source i (0 = embedding)", ylabel="target block j")
    if K <= 16:
        threshold = 0.6 * float(np.nanmax(P))
        for j in range(K):
            for i in range(j + 1):
                ax.text(i, j, f"{P[j, i]:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if P[j, i] > threshold else "white")
    ax.set_title(title or f"learned topology ({K} blocks)")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def plot_topology_panels(topologies: Mapping[str, object], path: str | Path, title: str | None = None,
                         max_columns: int = 6) -> Path:
    """Topologies side by side on one colour scale (`scripts/topology.py compare` and `evolution`)."""
    mats = {name: square_topology(P, min_blocks=1) for name, P in topologies.items()}
    if not mats:
        raise ValueError("no topologies to draw")
    vmax = max(1e-12, max(float(np.nanmax(P)) for P in mats.values()))
    cols = min(max_columns, len(mats))
    rows = -(-len(mats) // cols)
    fig, axes = subplots(rows, cols, figsize=(2.6 * cols + 0.8, 2.6 * rows + (0.4 if title else 0.0)), squeeze=False)
    for ax, (name, P) in zip(axes.flat, mats.items()):
        image = _draw_topology(ax, P, vmax, name, fontsize=7)
    for ax in list(axes.flat)[len(mats):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="p_ij", shrink=0.8)
    axes[0, 0].set_ylabel("target block j")
    axes[-1, 0].set_xlabel("source i")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def save_topology_gif(topologies: Mapping[str, object], path: str | Path, seconds_per_frame: float = 0.6) -> Path:
    """One heatmap per frame (same colour scale), as an animated GIF (Pillow)."""
    from PIL import Image

    mats = {name: square_topology(P, min_blocks=1) for name, P in topologies.items()}
    vmax = max(1e-12, max(float(np.nanmax(P)) for P in mats.values()))
    frames = []
    for name, P in mats.items():
        fig, ax = subplots(figsize=(4.2, 3.6))
        fig.colorbar(_draw_topology(ax, P, vmax, name, fontsize=7), ax=ax, label="p_ij")
        fig.canvas.draw()
        frames.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 * seconds_per_frame), loop=0)
    return path
