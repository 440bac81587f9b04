"""Metric curves: one subplot per metric, one line (with an optional +-std band) per run or group."""
from __future__ import annotations

import math
from pathlib import Path
import numpy as np

from .canvas import save_figure, subplots

Curve = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # x, mean, std (None: a single run)


def plot_panels(panels: dict[str, dict[str, Curve]], path: str | Path, xlabel: str = "step",
                title: str | None = None) -> Path:
    """panels: metric -> {label -> (x, mean, std | None)}; lines share colours across panels by label."""
    names = list(panels)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, name in zip(axes.flat, names):
        for label, (x, mean, std) in panels[name].items():
            ax.plot(x, mean, marker="o", markersize=3, color=colours[label], label=label or None)
            if std is not None:
                ax.fill_between(x, mean - std, mean + std, color=colours[label], alpha=0.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if any(labels):
        found = {text: handle for ax in axes.flat for handle, text in zip(*ax.get_legend_handles_labels())}
        fig.legend(list(found.values()), list(found), loc="lower center", ncol=min(4, len(labels)), fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 if any(labels) else 0, 1, 1))
    return save_figure(fig, path, dpi=110)
