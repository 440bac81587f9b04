"""The one place matplotlib is set up: figures drawn by Agg without pyplot, and saving one to a path.

pyplot is not imported: its import (backend selection, the figure manager) is slow, every training
run draws at its first checkpoint, and a figure that pyplot never saw needs no closing."""
from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] | None = None, **kwargs):
    """(figure, axes) as `matplotlib.pyplot.subplots` returns them, on an Agg canvas."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def save_figure(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Writes `fig` to `path` (parent folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


__all__ = ["colormaps", "save_figure", "subplots"]
