"""Training FLOPs per step of each arm, so that arms of different cost (width, depth, peer
topologies) can be compared at equal compute, not only at equal steps.

Counted once per model config (`ancre_dit.models.flops.count_training_flops`: network forward +
backward, matrix products only) on a CPU, fp32, with a micro-batch of two images, from the model
spec of one of the arm's checkpoints (the exact model the run trained, data shape included), then
scaled to a step: per image x train.global_batch_size. Optimizer, EMA and the recomputation of
train.grad_checkpointing are not in it. Cached in `<out>/flops.json`, keyed by the model spec.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..checkpoint import load_model_spec
from ..errors import UserError
from ..files import write_atomic
from ..training.checkpointing import list_checkpoints

CACHE = "flops.json"
MICRO_BATCH = 2


def flops_per_image(model_spec: dict[str, Any]) -> float:
    """Training FLOPs of one image through the model a checkpoint's model_spec.json describes."""
    import torch

    from ..models import create_model
    from ..models.flops import count_training_flops

    kwargs = dict(model_spec["model"]["kwargs"])
    torch.manual_seed(0)
    model = create_model(model_spec["model"]["name"], **kwargs).train()
    size, channels = int(kwargs.get("input_size", 32)), int(kwargs.get("in_channels", 4))
    classes = int(kwargs.get("num_classes", 1000))
    x = torch.randn(MICRO_BATCH, channels, size, size)
    t = torch.full((MICRO_BATCH,), 500, dtype=torch.long)
    y = torch.arange(MICRO_BATCH) % max(1, classes)
    return count_training_flops(model, x, t, y, autocast_dtype=None) / MICRO_BATCH


def _spec_of(run_dirs: Sequence[Path]) -> dict[str, Any] | None:
    for run_dir in run_dirs:
        saved = list_checkpoints(run_dir)
        if saved:
            try:
                return load_model_spec(saved[-1][1])
            except UserError:
                continue
    return None


def arm_flops_per_step(out: Path, arms: dict[str, tuple[Sequence[Path], int]]) -> dict[str, float | None]:
    """arm -> training FLOPs per step (None until one of its runs has a checkpoint). `arms` maps
    each arm to (its run folders, its global batch size)."""
    cache_path = out / CACHE
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        cache = {}  # a derived file: recounted
    counted = dict(cache.get("per_image", {}))
    result: dict[str, float | None] = {}
    for arm, (run_dirs, batch) in arms.items():
        spec = _spec_of(run_dirs)
        if spec is None:
            result[arm] = None
            continue
        key = json.dumps(spec["model"], sort_keys=True)
        if key not in counted:
            counted[key] = flops_per_image(spec)
        result[arm] = counted[key] * batch
    record = {"per_image": counted, "per_step": result,
              "note": "network forward + backward (matrix products), per image x train.global_batch_size"}
    if record != cache:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_path, json.dumps(record, indent=1).encode())
    return result
