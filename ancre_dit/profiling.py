"""Measurements shared by the benchmark scripts (not used in training)."""
from __future__ import annotations

import contextlib
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
