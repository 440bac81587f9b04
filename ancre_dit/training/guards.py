"""The non-finite guard of the training step: a NaN / inf loss or gradient norm never becomes an update.

Long DiT runs in bf16 can diverge late; without a guard, AdamW writes NaN into the weights, the
EMA follows, and `keep_last` replaces the good checkpoints with NaN ones. The guard is asked at
every optimizer step, before `optimizer.step()`; all ranks decide together (one all-reduce of a
flag), so they skip or stop the same step and stay in step.

Policies (train.nonfinite): `skip` drops the update (weights, optimizer state and EMA untouched)
up to train.nonfinite_max_skips times in a row, then stops; `stop` stops at the first one.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import UserError
from .config_schema import NONFINITE_POLICIES as POLICIES


class NonFiniteStop(UserError):
    """Training stopped on non-finite values; the message names the step, the terms and the last good checkpoint."""


class NonFiniteGuard:
    """`check(step, terms, grad_norm)` -> True when this step's update must be skipped; raises
    NonFiniteStop when the policy says stop. `scaler_handles_grads`: with fp16 the GradScaler
    already skips steps whose gradients overflow (and lowers its scale), which is routine, so only
    a non-finite loss counts then."""

    def __init__(self, accelerator, policy: str, max_skips: int, last_checkpoint: Callable[[], str],
                 warn: Callable[[str], None], scaler_handles_grads: bool = False):
        if policy not in POLICIES:
            raise UserError(f"train.nonfinite must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.accelerator = accelerator
        self.policy, self.max_skips = policy, max_skips
        self.last_checkpoint, self.warn = last_checkpoint, warn
        self.scaler_handles_grads = scaler_handles_grads
        self.in_a_row = 0
        self.total_skipped = 0

    def _any_rank(self, local_bad: bool) -> bool:
        if self.accelerator.num_processes == 1:
            return local_bad
        flag = torch.tensor([1.0 if local_bad else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def check(self, step: int, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | float) -> bool:
        values = {k: float(v) for k, v in terms.items()}
        norm = float(grad_norm)
        local_bad = not all(math.isfinite(v) for v in values.values())
        if not self.scaler_handles_grads:
            local_bad = local_bad or not math.isfinite(norm)
        if not self._any_rank(local_bad):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total_skipped += 1
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(values.items()))
        what = (f"step {step}: non-finite loss or gradient ({shown}, grad_norm {norm:.4g}"
                f"{'' if local_bad else ' here; non-finite on another rank'})")
        if self.policy == "stop" or self.in_a_row > self.max_skips:
            reason = ("train.nonfinite=stop" if self.policy == "stop"
                      else f"{self.in_a_row} non-finite steps in a row, more than train.nonfinite_max_skips={self.max_skips}")
            raise NonFiniteStop(f"training stopped at {what}: {reason}; no update was applied and nothing saved; "
                                f"last good checkpoint: {self.last_checkpoint()}; resume from it with a lower "
                                f"train.lr, train.grad_clip > 0 or train.mixed_precision=no")
        self.warn(f"{what}: update skipped ({self.in_a_row} in a row, stop after {self.max_skips}); "
                  f"weights, optimizer and EMA unchanged; last good checkpoint: {self.last_checkpoint()}")
        return True
