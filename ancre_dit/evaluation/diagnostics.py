"""How information moves through depth, for any topology: DAR's three diagnostics and the state of a
learned routing. Cheap enough to log while training (one forward + backward of a small fixed batch).

z_k is the state fed to block k + 1 (z_0 the embedding, z_K the trunk's output), as each topology
reports it through its `state_hook`; for routed models that is the aggregated state.
  forward inflation   RMS(z_k) over channels, averaged over samples and tokens
  backward decay      RMS(dL/dz_k) for the training loss of the batch
  redundancy          per-token cosine(z_k, z_{k+1}), averaged (k = 0..K-1)
For a topology with a (K, K) matrix: the mean normalised entropy of the rows of blocks 2..K, how many
blocks changed their strongest source since the previous look, and the largest EMA-vs-raw gap.
Also, for `scripts/topology.py diagnose`: a linear probe of the normalised time from each
mean-pooled z_k (ridge regression, R^2 on held-out pairs).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ..diffusion import Objective
from ..models import TopologyNotDefined


def _rms(z: torch.Tensor) -> float:
    return float(z.float().pow(2).mean().sqrt())


def depth_profile(model: torch.nn.Module, objective: Objective, x: torch.Tensor, y: torch.Tensor,
                  draws) -> dict[str, list[float]]:
    """{"rms": [K+1], "grad_rms": [K+1], "cosine": [K]} on a fixed batch; the model in eval mode
    (no label dropout) and the global random streams untouched, so training is unaffected."""
    return _profile_and_states(model, objective, x, y, draws)[0]


def _profile_and_states(model, objective, x, y, draws) -> tuple[dict[str, list[float]], list[torch.Tensor]]:
    """The depth profile and the states z_0..z_K of one forward + backward of the objective's loss.
    Gradients are taken for the states only: the parameters' .grad stays untouched."""
    topology, states = model.topology, []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), topology.exact_state_gradients():
            topology.state_hook = lambda k, z: states.append(z)
            try:
                loss = objective.losses(model, x, y, draws)["loss"].mean()
            finally:
                topology.state_hook = None
            grads = torch.autograd.grad(loss, states, allow_unused=True)
    finally:
        model.train(was_training)
    states = [s.detach() for s in states]
    grads = [torch.zeros_like(s) if g is None else g for s, g in zip(states, grads)]
    cosine = [float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())
              for a, b in zip(states[:-1], states[1:])]
    return {"rms": [_rms(z) for z in states], "grad_rms": [_rms(g) for g in grads], "cosine": cosine}, states


class RoutingWatch:
    """The routing's own diagnostics between two looks (nothing for schemes without a matrix)."""

    def __init__(self):
        self.previous: np.ndarray | None = None

    def look(self, ema_model: torch.nn.Module, raw_model: torch.nn.Module) -> dict[str, float]:
        try:
            P = raw_model.topology.probabilities().detach().double().cpu().numpy()
            P_ema = ema_model.topology.probabilities().detach().double().cpu().numpy()
        except TopologyNotDefined:
            return {}
        K = P.shape[0]
        strongest = np.array([int(np.argmax(P[j, : j + 1])) for j in range(K)])
        changed = 0 if self.previous is None else int((strongest != self.previous).sum())
        self.previous = strongest
        entropies = []
        for j in range(1, K):
            row = np.clip(P[j, : j + 1], 0, None)
            total = row.sum()
            if total > 0:
                q = row[row > 0] / total
                entropies.append(float(-(q * np.log(q)).sum() / np.log(j + 1)))
        return {"routing_entropy": float(np.mean(entropies)) if entropies else 0.0,
                "strongest_changed": changed,
                "ema_raw_gap": float(np.abs(P - P_ema).max())}


def time_probe_r2(features: np.ndarray, targets: np.ndarray, ridge: float = 1e-3, seed: int = 0) -> float:
    """R^2 on held-out pairs of a ridge regression of `targets` from `features` (N, D), fitted on a
    random half: how linearly readable the (normalised) time is from a representation."""
    n = len(targets)
    order = np.random.default_rng(seed).permutation(n)
    train, test = order[: n // 2], order[n // 2:]
    mu, sd = features[train].mean(0), features[train].std(0) + 1e-8
    A = np.hstack([(features - mu) / sd, np.ones((n, 1))])
    w = np.linalg.solve(A[train].T @ A[train] + ridge * len(train) * np.eye(A.shape[1]), A[train].T @ targets[train])
    residual = targets[test] - A[test] @ w
    spread = ((targets[test] - targets[test].mean()) ** 2).sum()
    return float(1.0 - (residual ** 2).sum() / spread) if spread > 0 else float("nan")


def fixed_draws(objective: Objective, x: torch.Tensor, times: list[float],
                seed: int = 0) -> Iterator[tuple[float, tuple[torch.Tensor, torch.Tensor]]]:
    """(u, (t, noise)) for each normalised time u in `times`: the batch's diffusion time and a noise
    fixed by `seed`, on x's device, so that every probe of a checkpoint sees the same draws."""
    g = torch.Generator().manual_seed(seed)
    for u in times:
        noise = torch.randn(x.shape, generator=g).to(x)
        yield u, (objective.times_at(u, x.shape[0]).to(x.device), noise)


def diagnose(model: torch.nn.Module, objective: Objective, x: torch.Tensor, y: torch.Tensor,
             times: list[float], seed: int = 0) -> dict[str, Any]:
    """The depth profile at each normalised time u in `times` (fixed noise per u), and the time
    probe's R^2 per depth over all of them (None when fewer than two times)."""
    profiles, pooled, targets = {}, [], []
    for u, draw in fixed_draws(objective, x, times, seed):
        profiles[f"{u:g}"], states = _profile_and_states(model, objective, x, y, draw)
        pooled.append(np.stack([s.float().mean(dim=1).cpu().numpy() for s in states]))  # (K+1, N, D)
        targets.append(np.full(x.shape[0], u))
    result: dict[str, Any] = {"times": list(times), "profiles": profiles, "time_probe_r2": None}
    if len(times) >= 2:
        feats, tgt = np.concatenate(pooled, axis=1), np.concatenate(targets)
        result["time_probe_r2"] = [time_probe_r2(feats[k], tgt, seed=seed) for k in range(feats.shape[0])]
    return result
