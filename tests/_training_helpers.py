"""Shared by the training tests (not collected): tiny configs and Accelerate state resets."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ancre_dit.training.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

# A model small enough for many CPU steps per second: 2 blocks, width 32, on the 8x8 digits.
TINY = ["model.name=DiT-T/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2", "model.topology=ancre",
        "data.kind=digits", "data.image_size=8", "data.num_workers=0", "train.global_batch_size=16",
        "train.lr=1e-3", "train.ema_decay=0.9", "train.mixed_precision=no", "train.log_every=1",
        "train.sample_every=0", "train.ckpt_every=1000", "log.tensorboard=false"]


def tiny_config(run_dir: Path, *overrides: str) -> Config:
    return load_config(None, [*TINY, f"run_dir={run_dir}", *overrides])


def reset_accelerate() -> None:
    """AcceleratorState is a process-wide singleton: reset it between in-process runs."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def deterministic_draws(self, x: torch.Tensor):
    """Replaces the trainer's random t / noise by a function of each sample alone, so runs with
    different process layouts see the same draws for the same sample."""
    flat = x.flatten(1)
    t = ((flat + 1.0) * 0.5 * torch.arange(1, flat.shape[1] + 1)).sum(1).round().long() % self.objective.num_timesteps
    noise = torch.sin(x * 12.9898 + torch.arange(x[0].numel()).view(x.shape[1:]) * 78.233) * 1.5
    return t, noise


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    env.pop("ANCRE_DEBUG", None)
    return env


def run_train(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT, **kwargs)
