"""The one place matplotlib is set up: the Agg backend, and saving a figure to a path."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Writes `fig` to `path` (parent folders made) and closes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


__all__ = ["plt", "save_figure"]
