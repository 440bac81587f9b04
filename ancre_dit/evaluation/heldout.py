"""Held-out loss: the training objective on fixed held-out examples with fixed noise and fixed times.

The cheap quality curve: it needs no sampling and no Inception weights. Every example is repeated
`draws` times; the times are stratified over the whole chain (M = examples x draws evenly spaced
timesteps, shuffled with a fixed seed so each example sees spread-out times) and the noise is drawn
once from a seeded generator, so two evaluations differ only by the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..diffusion import Objective
from ..errors import UserError


@dataclass
class HeldOutSet:
    """Fixed inputs of the held-out loss, all on the CPU: row i is (x[i], y[i], t[i], noise[i])."""
    x: torch.Tensor
    y: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor
    num_examples: int

    def __len__(self) -> int:
        return len(self.y)


def build_heldout_set(dataset: Dataset, kind: str, *, max_examples: int, draws: int, seed: int,
                      objective: Objective, latent_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> HeldOutSet:
    """The first `max_examples` items of `dataset` (digits: the held-out split; latents: stored
    moments, turned into one fixed posterior draw per row, normalised as training normalises them),
    `draws` rows each."""
    n = min(len(dataset), max_examples)
    if n < 1:
        raise UserError("the held-out set is empty; raise eval.heldout_from_train or point eval.val_path at data")
    items = [dataset[i] for i in range(n)]
    x = torch.stack([torch.as_tensor(item[0]) for item in items]).repeat_interleave(draws, dim=0)
    y = torch.tensor([int(item[1]) for item in items], dtype=torch.long).repeat_interleave(draws)
    g = torch.Generator().manual_seed(int(seed))
    if kind == "latents":  # the same augmentation as training (flip + posterior draw), drawn once
        from ..data.latent_shards import draw_latents_from_moments
        x = draw_latents_from_moments(x, generator=g)
        if latent_norm is not None:
            x = latent_norm(x.float())
    x = x.float()
    m = len(y)
    t = objective.evaluation_times(m)  # evenly spread over the process (DDPM timesteps, flow t)
    t = t[torch.randperm(m, generator=g)]
    noise = torch.randn(x.shape, generator=g, dtype=torch.float32)
    return HeldOutSet(x, y, t, noise, n)


@torch.no_grad()
def heldout_terms(model: torch.nn.Module, objective: Objective, held: HeldOutSet, ranges: list[tuple[int, int]],
                  device: torch.device) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Per-row loss terms (float64) of the rows in `ranges`, one batch per range; the model is run
    in eval mode (no label dropout) and left in the mode it had."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for start, end in ranges:
            terms = objective.losses(model, held.x[start:end].to(device), held.y[start:end].to(device),
                                     (held.t[start:end].to(device), held.noise[start:end].to(device)))
            out.append((start, {k: v.detach().double().cpu().numpy() for k, v in terms.items()}))
    finally:
        model.train(was_training)
    return out
