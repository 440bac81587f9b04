"""The non-finite guard of the training step: a NaN / inf loss or gradient norm never becomes an update
(else AdamW writes NaN into the weights, the EMA follows, and `keep_last` replaces the good checkpoints).

`flag()` decides on the device (a 0-d mask agreed by all ranks, which the fused optimizer and the EMA
take); `report()` reads it at log steps and before any periodic task, warns, names the data rows when
the inputs were non-finite, and raises NonFiniteStop. train.nonfinite: `skip` drops the update up to
train.nonfinite_max_skips times in a row, `stop` stops at the first; a run mostly skipped stops too.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import UserError

POLICIES = ("skip", "stop")  # train.nonfinite
# A run stops once more than this share of its steps were skipped (after MOST_SKIPPED_AFTER steps).
MOST_SKIPPED_SHARE = 0.5
MOST_SKIPPED_AFTER = 10


class NonFiniteStop(UserError):
    """Training stopped on non-finite values; the message names the step, the terms and the last good checkpoint."""


class NonFiniteGuard:
    """`flag(...)` -> a device mask for this step (1.0: skip); `report()` warns or raises for the steps
    since the last report. With fp16 the GradScaler already skips (routine) gradient overflows, so only
    a non-finite loss counts. `ctx`: the run's periodic.RunContext; `bad_rows(position)` names a step's bad data."""

    def __init__(self, ctx, last_checkpoint: Callable[[], str], bad_rows: Callable[[tuple[int, int]], str]):
        self.ctx, self.warn, self.last_checkpoint, self.bad_rows = ctx, ctx.log.warning, last_checkpoint, bad_rows
        self.policy, self.max_skips = ctx.config.train.nonfinite, ctx.config.train.nonfinite_max_skips
        self.scaler_handles_grads = ctx.config.train.mixed_precision == "fp16"
        self.in_a_row = self.total_skipped = self.steps_seen = 0
        # (step, data position, term names, device [terms..., grad_norm, local bad, agreed bad, inputs finite])
        self._pending: list[tuple[int, tuple[int, int], tuple[str, ...], torch.Tensor]] = []

    def flag(self, step: int, position: tuple[int, int], terms: dict[str, torch.Tensor], grad_norm: torch.Tensor,
             inputs_finite: torch.Tensor) -> torch.Tensor:
        """1.0 (on the device) when step `step` must not update anything, on every rank alike."""
        keys = tuple(sorted(terms))
        values = torch.stack([terms[k].detach().float().reshape(()) for k in keys])
        norm = grad_norm.detach().float().reshape(())
        bad = ~torch.isfinite(values).all()
        if not self.scaler_handles_grads:
            bad = bad | ~torch.isfinite(norm)
        local = bad.float()
        agreed = local
        if self.ctx.accelerator.num_processes > 1:
            agreed = (self.ctx.accelerator.reduce(local.clone(), reduction="sum") > 0).float()
        record = torch.cat([values, torch.stack([norm, local, agreed, inputs_finite.float().reshape(())])])
        self._pending.append((step, position, keys, record))
        return agreed

    def report(self) -> None:
        """Reads the steps flagged since the last report (one host read) and acts on them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows = torch.stack([values for *_, values in pending]).cpu().tolist()
        for (step, position, keys, _), row in zip(pending, rows):
            self.steps_seen += 1
            terms, (norm, local, agreed, inputs_finite) = dict(zip(keys, row[:len(keys)])), row[len(keys):]
            if not agreed:
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            self.total_skipped += 1
            self._act(step, position, terms, norm, bool(local), bool(inputs_finite))

    def _act(self, step: int, position: tuple[int, int], terms: dict[str, float], norm: float, local: bool,
             inputs_finite: bool) -> None:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(terms.items()))
        what = (f"step {step}: non-finite loss or gradient ({shown}, grad_norm {norm:.4g}"
                f"{'' if local else ' here; non-finite on another rank'})")
        if not inputs_finite:
            what += f"; its input batch itself is non-finite ({self.bad_rows(position)})"
        if self.policy == "stop":
            reason = "train.nonfinite=stop"
        elif self.in_a_row > self.max_skips:
            reason = f"{self.in_a_row} non-finite steps in a row, more than train.nonfinite_max_skips={self.max_skips}"
        elif self.steps_seen >= MOST_SKIPPED_AFTER and self.total_skipped > MOST_SKIPPED_SHARE * self.steps_seen:
            reason = f"{self.total_skipped} of the {self.steps_seen} steps so far were non-finite and skipped"
        else:
            self.warn(f"{what}: update skipped ({self.in_a_row} in a row, stop after {self.max_skips}); "
                      f"weights, optimizer and EMA unchanged; last good checkpoint: {self.last_checkpoint()}")
            return
        fix = ("fix or drop those rows (scripts/extract_latents.py --verify), then resume" if not inputs_finite
               else "resume from it with a lower train.lr, train.grad_clip > 0 or train.mixed_precision=no")
        raise NonFiniteStop(f"training stopped at {what}: {reason}; no non-finite update was applied and no "
                            f"checkpoint written since; last good checkpoint: {self.last_checkpoint()}; {fix}")
