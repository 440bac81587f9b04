"""The EMA copy of the model and its update, maskable on the device: the update's weight is
(1 - decay) x (1 - skip), so a skipped non-finite step leaves the EMA bitwise unchanged without a host read.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch


class EMA:
    """`module`: a frozen copy of the model in eval mode; `decay(updates)` the decay of the update
    that follows `updates` earlier ones."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = False):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.max_decay, self.warmup = decay, warmup

    def decay(self, updates: int) -> float:
        """DiT's constant, or with warm-up timm's ModelEmaV3 ramp 1 - (1 + n)^(-2/3) capped at the set decay (0 first: a
        copy), for short runs: a 0.999 EMA still holds ~13% of the initial weights after 2000 steps."""
        return min(1 - (1 + updates) ** (-2 / 3), self.max_decay) if self.warmup else self.max_decay


def ema_names(train) -> list[str]:
    """The weights-file names of a run's EMAs, in the trainer's order: ema (train.ema_decay), ema-<decay>
    (train.ema_decays), phema-<std> (train.phema.stds)."""
    return ["ema", *(f"ema-{d:g}" for d in train.ema_decays), *(f"phema-{s:g}" for s in train.phema.stds)]


def ema_update_(emas: EMA | Sequence[EMA], model: torch.nn.Module, updates: int, skip: torch.Tensor | None) -> None:
    """Each ema <- ema + w (model - ema) for floating tensors (others copied), w = (1 - decay) (1 - skip):
    one foreach call over every EMA given (several decays, the post-hoc EMAs)."""
    emas = [emas] if isinstance(emas, EMA) else list(emas)
    model_state = list(model.state_dict().values())
    ema_values, model_values, decays = [], [], []
    for ema in emas:
        decay = ema.decay(updates)
        for ema_v, model_v in zip(ema.module.state_dict().values(), model_state):
            if ema_v.is_floating_point():
                ema_values.append(ema_v)
                model_values.append(model_v)
                decays.append(decay)
            else:
                ema_v.copy_(model_v)
    if not ema_values:
        return
    if skip is None and len(set(decays)) == 1:
        weights = 1.0 - decays[0]
    elif skip is None:
        weights = [torch.tensor(1.0 - d, device=ema_values[0].device) for d in decays]
    else:
        # A 0-d device tensor where the Scalar overload wants a number would be read on the host;
        # the List overload reads each weight on the device (one lerp per tensor on CUDA, since its
        # fused kernel wants weights shaped like the values).
        keep = 1.0 - skip.to(ema_values[0].device, torch.float32)
        per_decay = {d: (1.0 - d) * keep for d in set(decays)}
        weights = [per_decay[d] for d in decays]
    with torch.no_grad():
        torch._foreach_lerp_(ema_values, model_values, weights)
