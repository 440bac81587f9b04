"""The backbone's learning rate at each optimizer step: a linear warm-up, then the schedule.

    constant      train.lr (DiT, SiT, REPA)
    cosine        from train.lr down to train.min_lr at train.max_steps, half a cosine period
    linear        from train.lr down to train.min_lr at train.max_steps, a straight line
    inverse-sqrt  train.lr / sqrt(max(step / train.lr_decay_start, 1)), not below train.min_lr (EDM2)

A pure function of the step, not a (stateful) torch scheduler: the trainer sets each group's lr
itself (the routing group has its own multiplier and warm-up), and a resume finds it from the step alone.
"""
from __future__ import annotations

import math

from ..errors import UserError
from .config_sections import TrainConfig


def lr_at(t: TrainConfig, step: int) -> float:
    """The lr of optimizer step `step` + 1 (so the first step of a warm-up already moves)."""
    n = step + 1
    warm = min(1.0, n / t.warmup_steps) if t.warmup_steps else 1.0
    if t.lr_schedule == "constant":
        return t.lr * warm
    if t.lr_schedule == "inverse-sqrt":
        return max(t.min_lr, t.lr / math.sqrt(max(n / t.lr_decay_start, 1.0))) * warm
    done = min(1.0, max(0.0, (n - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)))
    if t.lr_schedule == "cosine":
        return (t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))) * warm
    return (t.lr + (t.min_lr - t.lr) * done) * warm


def check_lr_schedule(t: TrainConfig) -> None:
    """The settings each schedule needs, and none it would ignore silently."""
    if t.min_lr > t.lr:
        raise UserError(f"train.min_lr={t.min_lr:g} is above train.lr={t.lr:g}; choose a floor at most the lr")
    if t.min_lr and t.lr_schedule == "constant":
        raise UserError(f"train.min_lr={t.min_lr:g} has no effect with train.lr_schedule=constant; "
                        "choose cosine, linear or inverse-sqrt, or drop train.min_lr")
    if t.lr_schedule == "inverse-sqrt" and not t.lr_decay_start:
        raise UserError("train.lr_schedule=inverse-sqrt needs train.lr_decay_start (the step after which the lr "
                        "falls as 1/sqrt(step); EDM2's ref_batches, e.g. 70000)")
    if t.lr_decay_start and t.lr_schedule != "inverse-sqrt":
        raise UserError(f"train.lr_decay_start applies to train.lr_schedule=inverse-sqrt, not {t.lr_schedule}; "
                        "drop it or choose inverse-sqrt")
    if t.lr_schedule in ("cosine", "linear") and t.warmup_steps >= t.max_steps:
        raise UserError(f"train.warmup_steps={t.warmup_steps} leaves no steps to decay over before "
                        f"train.max_steps={t.max_steps}; lower train.warmup_steps")
