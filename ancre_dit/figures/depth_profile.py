"""diagnostics.png: how the depth profile of a run evolved (evaluation/diagnostics.py's records)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .canvas import save_figure, subplots

PROFILES = (("rms", "forward: RMS of z_k", True), ("grad_rms", "backward: RMS of dL/dz_k", True),
            ("cosine", "redundancy: cos(z_k, z_k+1)", False))
ROUTING = (("routing_entropy", "routing: mean row entropy / log j"),
           ("strongest_changed", "blocks whose strongest source changed"),
           ("ema_raw_gap", "largest |P_ema - P_raw|"))


def _plot_profiles(axes, profiles: list[tuple[str, dict[str, Any]]], colours, cosine_xlabel: str) -> None:
    for ax, (key, title, log_y) in zip(axes, PROFILES):
        for colour, (label, profile) in zip(colours, profiles):
            start = 1 if key == "cosine" else 0
            ax.plot(range(start, start + len(profile[key])), profile[key], marker="o", markersize=3, color=colour,
                    label=label)
        ax.set_title(title, fontsize=10)
        ax.set(xlabel=cosine_xlabel if key == "cosine" else "k (0 = embedding)", yscale="log" if log_y else "linear")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)


def plot_diagnostics(records: Sequence[dict[str, Any]], path: str | Path, snapshots: int = 4) -> Path | None:
    """Depth profiles at a few steps (darker = later); below, a learned routing's statistics. None without records."""
    from matplotlib import colormaps

    records = sorted(records, key=lambda r: r["step"])
    if not records:
        return None
    routed = [key for key, _ in ROUTING if key in records[-1]]
    rows = 2 if routed else 1
    fig, axes = subplots(rows, 3, figsize=(13.5, 3.6 * rows), squeeze=False)
    picks = sorted({int(i) for i in np.linspace(0, len(records) - 1, min(snapshots, len(records)))})
    _plot_profiles(axes[0], [(f"step {records[i]['step']}", records[i]) for i in picks],
                   colormaps["viridis"](np.linspace(0.85, 0.0, len(picks))), "k (cosine: between k-1 and k)")
    if routed:
        steps = [r["step"] for r in records]
        for ax, (key, title) in zip(axes[1], ROUTING):
            ax.plot(steps, [r.get(key, np.nan) for r in records], marker="o", markersize=3)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def plot_diagnosis(result: dict[str, Any], path: str | Path) -> Path:
    """`scripts/topology.py diagnose`: depth profiles per normalised time t, and the time probe's R^2."""
    from matplotlib import colormaps

    fig, axes = subplots(1, 4, figsize=(18, 3.8), squeeze=False)
    _plot_profiles(axes[0], [(f"t={t}", profile) for t, profile in result["profiles"].items()],
                   colormaps["plasma"](np.linspace(0.0, 0.85, len(result["profiles"]))), "k (0 = embedding)")
    probe = axes[0, 3]
    if result.get("time_probe_r2") is not None:
        probe.plot(range(len(result["time_probe_r2"])), result["time_probe_r2"], marker="o", markersize=3)
    probe.set_title("linear probe of t: held-out R^2", fontsize=10)
    probe.set_xlabel("k (0 = embedding)")
    probe.grid(alpha=0.3)
    fig.suptitle(f"{result.get('topology', '')} step {result.get('step')} ({result.get('inputs', '')})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
