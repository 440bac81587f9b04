"""Figures and summaries of a run: topology heatmap, loss curves, sample grids, topology analysis.

Matplotlib runs on the Agg backend (no display needed). A topology matrix P is (K, K) with
row j = block j+1's incoming weights over sources i = 0..j (0 = the embedding h_0, i = the output
of block i), zeros above the diagonal, as `model.topology.probabilities()` returns it.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402



def _as_matrix(P) -> np.ndarray:
    P = P.detach().float().cpu().numpy() if isinstance(P, torch.Tensor) else np.asarray(P, dtype=np.float64)
    if P.ndim != 2 or P.shape[0] != P.shape[1] or P.shape[0] == 0:
        raise ValueError(f"a topology must be a square (K, K) matrix, got shape {P.shape}")
    return P


def _prepare(path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_topology_heatmap(P, path, title: str | None = None) -> Path:
    """Lower-triangular heatmap of P: rows = target block, columns = source (0 = embedding).

    Cells are annotated with their weight when K <= 16; entries above the diagonal are blank.
    """
    P = _as_matrix(P)
    K = P.shape[0]
    masked = np.ma.masked_where(np.triu(np.ones_like(P, dtype=bool), k=1), P)
    size = max(4.0, 0.45 * K + 2.0)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    image = ax.imshow(masked, cmap="viridis", vmin=0.0, vmax=max(1e-12, float(np.nanmax(P))), interpolation="nearest")
    fig.colorbar(image, ax=ax, label="p_ij")
    ticks = np.arange(K)
    step = 1 if K <= 16 else max(1, K // 12)
    ax.set_xticks(ticks[::step], [str(i) for i in ticks[::step]])
    ax.set_yticks(ticks[::step], [str(j + 1) for j in ticks[::step]])
    ax.set_xlabel("source i (0 = embedding)")
    ax.set_ylabel("target block j")
    if K <= 16:
        threshold = 0.6 * float(np.nanmax(P))
        for j in range(K):
            for i in range(j + 1):
                ax.text(i, j, f"{P[j, i]:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if P[j, i] > threshold else "white")
    ax.set_title(title or f"learned topology ({K} blocks)")
    fig.tight_layout()
    path = _prepare(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _curve_stats(values) -> tuple[np.ndarray, np.ndarray | None]:
    """1-D -> (curve, None); 2-D (runs, points) -> (mean, std over runs)."""
    values = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=np.float64)
    if values.ndim == 1:
        return values, None
    if values.ndim == 2:
        return values.mean(axis=0), (values.std(axis=0) if values.shape[0] > 1 else None)
    raise ValueError(f"losses must be 1-D (one run) or 2-D (runs, points), got shape {values.shape}")


def plot_loss_curve(steps, losses, path, label: str | None = None, title: str | None = None,
                    ylabel: str = "loss", log_y: bool = False) -> Path:
    """Plots loss against step.

    `losses` is one curve (1-D), several runs of one setting (2-D (runs, points): drawn as the
    mean with a +-1 std band), or a mapping label -> either of those for several settings.
    """
    curves = dict(losses) if isinstance(losses, Mapping) else {label: losses}
    steps = np.asarray(steps)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in curves.items():
        mean, spread = _curve_stats(values)
        if mean.shape != steps.shape:
            raise ValueError(f"{len(steps)} steps but {mean.shape[0]} loss values for {name or 'the curve'}")
        line, = ax.plot(steps, mean, label=name, marker="o", markersize=3)
        if spread is not None:
            ax.fill_between(steps, mean - spread, mean + spread, color=line.get_color(), alpha=0.2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if any(name is not None for name in curves):
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = _prepare(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_image_grid(images, path, nrow: int = 8, scale: int | None = None) -> Path:
    """Saves a grid PNG of uint8 NHWC images (ADM sample layout) or float NCHW images in [-1, 1].

    `scale` is an integer nearest-neighbour upscale; by default small images (e.g. 8x8 digits)
    are enlarged to at least 64 pixels a side so the grid is readable.
    """
    from torchvision.utils import make_grid, save_image

    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images.detach().cpu()
    if x.ndim != 4:
        raise ValueError(f"images must be a 4-D batch (NHWC uint8 or NCHW float), got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.permute(0, 3, 1, 2).float() / 255.0
    else:
        x = ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    if scale is None:
        scale = max(1, -(-64 // min(x.shape[-2:])))
    if scale > 1:
        x = torch.nn.functional.interpolate(x, scale_factor=scale, mode="nearest")
    grid = make_grid(x, nrow=nrow, padding=max(1, scale), pad_value=0.5)
    path = _prepare(path)
    save_image(grid, str(path))
    return path


def topology_summary(P) -> dict:
    """The paper's topology analysis of P (K, K).

    Per block j (1..K): the strongest incoming source, the weight on the anchors (the embedding
    and the first block, sources 0 and 1, the paper's "first two nodes"), the weight on the
    immediate predecessor (source j-1), and the entropy of the incoming weights (nats; log(j) is
    uniform). Aggregates: mean anchor weight over blocks 3..K (where anchors are not simply the
    only or local sources), the fraction of those blocks whose strongest source is an anchor,
    and the mean normalised entropy (entropy / log(j), 1 = uniform, 0 = one edge).
    """
    P = _as_matrix(P)
    K = P.shape[0]
    blocks = []
    for j in range(K):
        row = P[j, : j + 1]
        positive = row[row > 0]
        total = positive.sum()
        entropy = float(-(positive / total * np.log(positive / total)).sum()) if total > 0 else 0.0
        blocks.append({
            "block": j + 1,
            "strongest_source": int(np.argmax(row)),
            "strongest_weight": float(row.max()),
            "anchor_weight": float(row[: min(2, j + 1)].sum()),
            "previous_weight": float(row[j]),
            "entropy": entropy,
            "normalized_entropy": entropy / float(np.log(j + 1)) if j > 0 else 0.0,
        })
    deep = blocks[2:]  # blocks 1 and 2 see only anchors
    summary = {
        "num_blocks": K,
        "blocks": blocks,
        "mean_anchor_weight_deep": float(np.mean([b["anchor_weight"] for b in deep])) if deep else None,
        "anchor_strongest_fraction_deep": (float(np.mean([b["strongest_source"] <= 1 for b in deep]))
                                           if deep else None),
        "mean_previous_weight": float(np.mean([b["previous_weight"] for b in blocks])),
        "mean_normalized_entropy": (float(np.mean([b["normalized_entropy"] for b in blocks[1:]]))
                                    if K > 1 else 0.0),
    }
    return summary


def format_topology_summary(summary: dict) -> str:
    """A short human-readable table of `topology_summary`'s output."""
    lines = [f"{'block':>5} {'strongest':>9} {'weight':>7} {'anchors':>7} {'previous':>8} {'H/log j':>7}"]
    for b in summary["blocks"]:
        lines.append(f"{b['block']:>5} {b['strongest_source']:>9} {b['strongest_weight']:>7.3f} "
                     f"{b['anchor_weight']:>7.3f} {b['previous_weight']:>8.3f} {b['normalized_entropy']:>7.3f}")
    if summary["mean_anchor_weight_deep"] is not None:
        lines.append(f"blocks 3..{summary['num_blocks']}: mean anchor weight {summary['mean_anchor_weight_deep']:.3f}, "
                     f"strongest source is an anchor in {100 * summary['anchor_strongest_fraction_deep']:.0f}%")
    lines.append(f"mean weight on the previous block {summary['mean_previous_weight']:.3f}, "
                 f"mean normalised entropy {summary['mean_normalized_entropy']:.3f}")
    return "\n".join(lines)


def _draw_topology(ax, P: np.ndarray, vmax: float, title: str):
    masked = np.ma.masked_where(np.triu(np.ones_like(P, dtype=bool), k=1), P)
    image = ax.imshow(masked, cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    K = P.shape[0]
    step = 1 if K <= 12 else max(1, K // 6)
    ax.set_xticks(np.arange(K)[::step], [str(i) for i in range(K)][::step], fontsize=7)
    ax.set_yticks(np.arange(K)[::step], [str(j + 1) for j in range(K)][::step], fontsize=7)
    ax.set_title("\n".join(textwrap.wrap(title, 22)), fontsize=8)  # long run names wrap instead of overlapping
    return image


def plot_topology_panels(topologies: Mapping[str, object], path, title: str | None = None,
                         max_columns: int = 6) -> Path:
    """Several topologies side by side (rows of at most `max_columns`) on one shared colour scale:
    `scripts/topology.py compare` (one panel per run) and `evolution` (one per checkpoint)."""
    mats = {name: _as_matrix(P) for name, P in topologies.items()}
    if not mats:
        raise ValueError("no topologies to draw")
    vmax = max(1e-12, max(float(np.nanmax(P)) for P in mats.values()))
    cols = min(max_columns, len(mats))
    rows = -(-len(mats) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols + 0.8, 2.6 * rows + (0.4 if title else 0.0)),
                             squeeze=False)
    image = None
    for ax, (name, P) in zip(axes.flat, mats.items()):
        image = _draw_topology(ax, P, vmax, name)
    for ax in list(axes.flat)[len(mats):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="p_ij", shrink=0.8)
    axes[0, 0].set_ylabel("target block j")
    axes[-1, 0].set_xlabel("source i")
    if title:
        fig.suptitle(title)
    path = _prepare(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_topology_gif(topologies: Mapping[str, object], path, seconds_per_frame: float = 0.6) -> Path:
    """One heatmap per frame (same colour scale), as an animated GIF (Pillow)."""
    from PIL import Image

    mats = {name: _as_matrix(P) for name, P in topologies.items()}
    vmax = max(1e-12, max(float(np.nanmax(P)) for P in mats.values()))
    frames = []
    for name, P in mats.items():
        fig, ax = plt.subplots(figsize=(4.2, 3.6))
        fig.colorbar(_draw_topology(ax, P, vmax, name), ax=ax, label="p_ij")
        fig.canvas.draw()
        frames.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()))
        plt.close(fig)
    path = _prepare(path)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 * seconds_per_frame), loop=0)
    return path
