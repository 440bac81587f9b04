"""Training: typed config, data order and adapters, atomic checkpoints, the Accelerate loop.

The trainer is imported on first use, so that checking a config on the command line stays quick.
"""
from __future__ import annotations

from typing import Any

from .config import Config, load_config

__all__ = ["Config", "load_config", "Trainer", "train"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "train"):
        from . import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
