"""Training FLOPs of a model, counted rather than estimated, so that runs of different topologies or
widths can be compared at equal compute (MFU, the FLOPs axis of a study's curves)."""
from __future__ import annotations

from contextlib import nullcontext, suppress
from typing import Callable

import torch


def count_training_flops(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                         autocast_dtype: torch.dtype | None = torch.bfloat16) -> int:
    """FLOPs of one forward + backward on (x, t, y) by `FlopCounterMode` (gradients dropped); `autocast_dtype`
    None runs in fp32 (the same count, faster on a CPU). SDPA's math backend: the counter's formulas for fused
    attention kernels depend on backend and torch version."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)  # (autocast refuses the meta device: only when asked)
    amp = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    with counter, sdpa_kernel(SDPBackend.MATH):
        with amp:
            out = model(x, t, y)
        out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


# Below this many parameters x input pixels x images, the CPU counts faster than the meta device's Python kernels.
CPU_COUNT_LIMIT = 1e9


def flops_per_training_image(build: Callable[[str], torch.nn.Module], in_channels: int, input_size: int,
                             batch: int = 1, device: str | None = None) -> float:
    """Training FLOPs of one image through `build(device)`'s model. `device` None: a large model is counted
    on the meta device, a small one (or one without meta kernels) on the CPU. The random state is kept."""
    def built(device: str) -> torch.nn.Module:
        with torch.device(device):
            return build(device).train()

    def count(model: torch.nn.Module, device: str) -> float:  # run outside the device context: no mode sees every op
        x = torch.zeros(batch, in_channels, input_size, input_size, device=device)
        t = y = torch.zeros(batch, dtype=torch.long, device=device)
        return count_training_flops(model, x, t, y, autocast_dtype=None) / batch

    with torch.random.fork_rng(devices=[]):  # the build's initialisation and the forward's label dropout
        if device is not None:
            return count(built(device), device)
        with suppress(RuntimeError, NotImplementedError):  # (a layer with no meta kernel)
            model = built("meta")
            if sum(p.numel() for p in model.parameters()) * input_size ** 2 * batch >= CPU_COUNT_LIMIT:
                return count(model, "meta")
        return count(built("cpu"), "cpu")
