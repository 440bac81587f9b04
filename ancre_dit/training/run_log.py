"""What a training run reports: its text log, the metrics at log steps (RUN/logs/metrics.jsonl, the
trackers, the progress bar), the loss curve and how the launch's time split between steps and tasks."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from ..files import append_jsonl, read_jsonl
from .checkpointing import topology_matrix

LOG_FILE = "log.txt"
METRICS_FILE = "metrics.jsonl"


def make_logger(run_dir: Path, main: bool) -> logging.Logger:
    """INFO to RUN/log.txt and the console on the main process; other processes log warnings only."""
    logger = logging.getLogger(f"ancre_dit.train.{run_dir.resolve()}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if main else logging.WARNING)
    if main:
        fmt = logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S")
        for handler in (logging.FileHandler(run_dir / LOG_FILE), logging.StreamHandler()):
            handler.setFormatter(fmt)
            logger.addHandler(handler)
    return logger


class MetricsLog:
    """Sums each step's loss terms on the device (`add`, no host read); `write` (collective) averages
    them over the steps since the last record and over all processes, and writes one record.
    `peak_source` names what the MFU's `peak_tflops` is (hardware.peak_tflops)."""

    def __init__(self, ctx, flops_per_image: float, peak_tflops: float | None, peak_source: str):
        self.ctx, self.flops_per_image = ctx, flops_per_image
        self.peak_tflops, self.peak_source = peak_tflops, peak_source
        self.path = ctx.run_dir / "logs" / METRICS_FILE
        self.learned_topology = any(True for _ in ctx.raw_model.topology.parameters())  # its matrix is tracked
        self.last: dict[str, float] = {}
        self.start(0.0)

    def start(self, now: float) -> None:
        """An interval starts now (the first one after the launch's setup)."""
        self.sums: dict[str, torch.Tensor] = {}
        self.lr_sum, self.count, self.started = 0.0, 0, now

    def add(self, terms: dict[str, torch.Tensor], lr: float) -> None:
        for key, value in terms.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.lr_sum += lr
        self.count += 1

    def write(self, now: float, progress_bar) -> dict[str, float]:
        """The record of the interval ending at the current step: metrics.jsonl and the trackers (main
        process), the progress bar and one log line."""
        acc, count, step = self.ctx.accelerator, self.count, self.ctx.progress.step
        keys = sorted(self.sums)
        local = torch.stack([self.sums[k] / count for k in keys])
        mean = acc.reduce(local, reduction="mean")  # the logged loss is averaged over all processes
        metrics = {k: float(v) for k, v in zip(keys, mean.tolist())}
        metrics["lr"] = self.lr_sum / count
        # Rates per process are per GPU; MFU is against the device's peak (None when that is unknown).
        elapsed, images = now - self.started, count * self.ctx.config.train.global_batch_size
        per_process = images / elapsed / acc.num_processes
        tflops = per_process * self.flops_per_image / 1e12
        metrics.update(steps_per_s=count / elapsed, images_per_s_total=images / elapsed,
                       images_per_s_per_process=per_process, tflops_per_s=tflops,
                       mfu=tflops / self.peak_tflops if self.peak_tflops else None)
        metrics["train_seconds"] = round(self.ctx.progress.train_seconds, 3)
        if acc.is_main_process:
            append_jsonl(self.path, {"step": step, **metrics, "peak_tflops": self.peak_tflops,
                                     "peak_source": self.peak_source})
            tracked = {f"train/{k}": v for k, v in metrics.items() if v is not None}
            P = topology_matrix(self.ctx.raw_model) if self.learned_topology else None
            if P is not None:  # the lower triangle, row by row
                tracked.update({f"topology/p_{j + 1}_{i}": float(P[j, i]) for j, i in zip(*np.tril_indices(len(P)))})
            acc.log(tracked, step=step)
        mfu = metrics["mfu"]
        progress_bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s_gpu=f"{metrics['images_per_s_per_process']:.1f}",
                                 **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}))
        self.ctx.log.info("step %d: loss %.4f, %.2f steps/s, %.1f images/s (%.1f per process)%s", step,
                          metrics["loss"], metrics["steps_per_s"], metrics["images_per_s_total"],
                          metrics["images_per_s_per_process"], f", MFU {mfu:.1%}" if mfu is not None else "")
        self.last = metrics
        self.start(now)
        return metrics


def log_time_shares(log: logging.Logger, train_seconds: float, tasks: Iterable[Any]) -> None:
    """How this launch's time split between the optimizer steps and each periodic task."""
    parts = {task.name: task.seconds for task in tasks}
    total = train_seconds + sum(parts.values())
    if total <= 0:
        return
    shares = ", ".join(f"{name} {sec:.1f} s ({100 * sec / total:.1f}%)" for name, sec in parts.items())
    log.info("time in this launch: training %.1f s (%.1f%%), %s", train_seconds, 100 * train_seconds / total, shares)


def plot_loss(run_dir: Path) -> None:
    """RUN/loss.png from metrics.jsonl (every launch's records): the loss, and beside it the lr."""
    rows = read_jsonl(run_dir / "logs" / METRICS_FILE)
    if rows:
        from ..figures import plot_panels
        steps = np.array([r["step"] for r in rows])
        panels = {key: {"": (steps, np.array([r[key] for r in rows], dtype=float), None)} for key in ("loss", "lr")
                  if all(key in r for r in rows)}
        plot_panels(panels, run_dir / "loss.png")
