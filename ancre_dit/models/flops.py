"""Training FLOPs of a model, counted rather than estimated, so that runs of different
topologies or widths can be compared at equal compute (MFU in benchmarks/gpu_check.py, the
FLOPs axis of a study's curves)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

__all__ = ["count_training_flops"]


def count_training_flops(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                         autocast_dtype: torch.dtype | None = torch.bfloat16) -> int:
    """FLOPs of one forward + backward on the batch (x, t, y), as `FlopCounterMode` counts them
    (matrix products, attention included; elementwise work is not counted). `autocast_dtype` None
    runs in fp32: the same count, and much faster on a CPU without bf16 units. The gradients it
    makes are dropped again.

    Counted with SDPA's math backend: its matrix products are counted on every device, while the
    counter's formulas for fused attention kernels depend on the backend and the torch version (the
    CPU flash kernel is not counted at all, which drops DiT-S/2 from 36.3 to 32.7 GFLOP an image)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        # No autocast context at all in fp32, so that a model on the meta device (shapes only) can be counted.
        with torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext():
            out = model(x, t, y)
        out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())
