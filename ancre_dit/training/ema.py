"""The EMA update of the training step, maskable on the device.

timm's ModelEmaV3 holds the EMA copy and its warm-up schedule; its update takes the decay as a
Python float, so skipping a non-finite step would need the skip decision on the host. Here the
interpolation weight is a device tensor, (1 - decay) x (1 - skip): a skipped step leaves the EMA
bitwise unchanged without a host read.
"""
from __future__ import annotations

import torch
from timm.utils import ModelEmaV3


def ema_update_(ema: ModelEmaV3, model: torch.nn.Module, step: int | None, skip: torch.Tensor | None) -> None:
    """ema <- ema + w (model - ema) for floating tensors (others copied), w = (1 - decay) (1 - skip)."""
    decay = ema.get_decay(step)
    ema_values, model_values = [], []
    for ema_v, model_v in zip(ema.module.state_dict().values(), model.state_dict().values()):
        if ema_v.is_floating_point():
            ema_values.append(ema_v)
            model_values.append(model_v)
        else:
            ema_v.copy_(model_v)
    if not ema_values:
        return
    weight = 1.0 - decay if skip is None else (1.0 - decay) * (1.0 - skip.to(ema_values[0].device, torch.float32))
    with torch.no_grad():
        torch._foreach_lerp_(ema_values, model_values, weight)
