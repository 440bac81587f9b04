"""Measurements the benchmark harnesses share (not used in training; the library never imports benchmarks/)."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Sequence

import torch


def saved_activation_bytes(model: torch.nn.Module, batch: Sequence[torch.Tensor],
                           autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
    """Bytes autograd keeps for backward in one forward (parameters excluded, each storage once):
    the activation memory of a step, measurable on the CPU where there is no CUDA peak counter."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = model(*batch).float().square().mean()
    del loss
    return sum(seen.values())


def aggregation_share(model: torch.nn.Module, batch: Sequence[torch.Tensor], steps: int = 3) -> tuple[float, float]:
    """(seconds in ANCRe's stacked aggregation, seconds in the whole step), per eager forward + backward.

    The aggregation's time is the profiler's total of its autograd functions' forward and backward
    nodes (`_StackedNode` of the stacked form; their child ops included); both numbers come from the same steps, so a shared machine's
    drifts, which swamp a 2% difference between two separately timed models, cancel out of their
    ratio. It estimates ANCRe / cascaded - 1 on the assumption that the blocks cost the same in both.
    """
    from torch.profiler import ProfilerActivity, profile  # (only the benchmarks that ask pay for its import)

    names = ("_StackedNode", "_StackedNodeBackward")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(*batch).float().square().mean().backward()
        elapsed = time.perf_counter() - start
    aggregated = sum(e.cpu_time_total for e in prof.key_averages() if e.key in names) / 1e6
    return aggregated / steps, elapsed / steps
