"""The paper's topology tools (scripts/topology.py is their command line): compare learned topologies
across runs, summarise one per block, prune one to a sparse frozen topology, the Tsallis-entropy regulariser.
A topology is the (K, K) matrix P of `probabilities()`; block 1's single edge is 1 in every normalised
topology, so comparisons use the *learned* edges only: rows 2..K (K(K+1)/2 - 1 edges).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ...errors import MissingFileError, UserError
from .base import ResidualTopology, load_topology_json, save_topology_json


def topology_file(path: str | Path) -> Path:
    """The topology.json a path names: the file itself, or a run directory's newest one."""
    path = Path(path)
    if path.is_dir():
        if not (path / "topology.json").is_file():
            raise MissingFileError(f"{path} holds no topology.json: pass a run of a topology with a (K, K) matrix "
                                   f"(ancre and its ablations, denseformer) or a topology.json; HC, mHC, DAR and "
                                   f"AttnRes have none (topology.py diagnose works for them, show --t for DAR and "
                                   f"AttnRes)")
        path = path / "topology.json"
    return path


def load_topology(path: str | Path) -> np.ndarray:
    """P from a topology.json or a run directory's; all zeros (a plain DiT, nothing to compare) is refused."""
    path = topology_file(path)
    P = load_topology_json(path).double().numpy()
    if not np.any(P):
        raise UserError(f"{path} is all zeros: a plain DiT (cascaded) has no routing to compare, prune or "
                        f"follow; pass a run of a topology with learned routing (e.g. ancre)")
    return P


def checkpoint_topologies(run_dir: str | Path) -> list[tuple[int, np.ndarray]]:
    """(step, P) of every RUN/checkpoints/<step>/topology.json, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = sorted((int(p.parent.name), p) for p in root.glob("*/topology.json") if p.parent.name.isdigit())
    if not found:
        raise MissingFileError(f"no checkpoints/<step>/topology.json under {run_dir}; pass a run directory whose "
                               f"topology has learned weights (e.g. ancre)")
    return [(step, load_topology(p)) for step, p in found]


def square_topology(P, min_blocks: int = 2) -> np.ndarray:
    """P (tensor or array) as a float64 (K, K) array, K >= min_blocks; a UserError for any other shape."""
    P = np.asarray(P.detach().float().cpu() if isinstance(P, torch.Tensor) else P, dtype=np.float64)
    if P.ndim != 2 or P.shape[0] != P.shape[1] or P.shape[0] < min_blocks:
        raise UserError(f"a topology must be a square (K, K) matrix with K >= {min_blocks} block(s), "
                        f"got shape {P.shape}")
    return P


def learned_edges(P) -> np.ndarray:
    """The weights of the learned edges: rows 2..K (blocks 2..K), sources 0..j, row by row."""
    P = square_topology(P)
    return P[np.tril_indices(P.shape[0])][1:]  # (row 0's one entry comes first)


def pearson(P, Q) -> float:
    """Pearson correlation of two same-depth topologies' learned edges (NaN if one is constant on them)."""
    a, b = learned_edges(P), learned_edges(Q)
    if a.shape != b.shape:
        raise UserError(f"cannot compare topologies of different depths ({square_topology(P).shape[0]} and "
                        f"{square_topology(Q).shape[0]} blocks)")
    a, b = a - a.mean(), b - b.mean()
    norm = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / norm) if norm > 0 else float("nan")


def strongest_edge_agreement(P, Q) -> float:
    """Fraction of blocks 2..K whose strongest incoming source is the same in both (ties: the lowest)."""
    a, b = ([int(np.argmax(M[j, : j + 1])) for j in range(1, len(M))] for M in map(square_topology, (P, Q)))
    if len(a) != len(b):
        raise UserError(f"cannot compare topologies of different depths ({len(a) + 1} and {len(b) + 1} blocks)")
    return float(np.mean(np.equal(a, b)))


def compare_topologies(topologies: Mapping[str, np.ndarray]) -> dict:
    """Pairwise Pearson and strongest-edge agreement of named topologies, plus their means."""
    if len(topologies) < 2:
        raise UserError("compare needs at least two topologies (run directories or topology.json files)")
    pairs = [{"a": name_a, "b": name_b, "pearson": pearson(P, Q), "agreement": strongest_edge_agreement(P, Q)}
             for (name_a, P), (name_b, Q) in itertools.combinations(topologies.items(), 2)]
    return {"pairs": pairs,
            "mean_pearson": float(np.mean([p["pearson"] for p in pairs])),
            "mean_agreement": float(np.mean([p["agreement"] for p in pairs]))}


def format_comparison(result: dict) -> str:
    width = max(len(p["a"]) + len(p["b"]) for p in result["pairs"]) + 6
    lines = [f"{'pair':<{width}} {'pearson':>8} {'strongest-edge agreement':>25}"]
    for p in result["pairs"]:
        lines.append(f"{p['a'] + ' vs ' + p['b']:<{width}} {p['pearson']:>8.3f} {100 * p['agreement']:>24.1f}%")
    lines.append(f"{'mean':<{width}} {result['mean_pearson']:>8.3f} {100 * result['mean_agreement']:>24.1f}%")
    return "\n".join(lines)


def topology_summary(P) -> dict:
    """The paper's analysis of P (K, K). Per block: the strongest incoming source, the weight on the anchors
    (sources 0 and 1, the paper's "first two nodes"), on the predecessor, the incoming entropy (nats).
    Over blocks 3..K (where anchors are not the only sources): the mean anchor weight and how often the
    strongest source is an anchor; the mean normalised entropy (entropy / log(j): 1 = uniform)."""
    P = square_topology(P, min_blocks=1)
    K = P.shape[0]
    blocks = []
    for j in range(K):
        row = P[j, : j + 1]
        positive = row[row > 0]
        total = positive.sum()
        entropy = float(-(positive / total * np.log(positive / total)).sum()) if total > 0 else 0.0
        blocks.append({"block": j + 1, "strongest_source": int(np.argmax(row)), "strongest_weight": float(row.max()),
                       "anchor_weight": float(row[: min(2, j + 1)].sum()), "previous_weight": float(row[j]),
                       "entropy": entropy, "normalized_entropy": entropy / float(np.log(j + 1)) if j > 0 else 0.0})
    deep = blocks[2:]  # blocks 1 and 2 see only anchors
    return {"num_blocks": K, "blocks": blocks,
            "mean_anchor_weight_deep": float(np.mean([b["anchor_weight"] for b in deep])) if deep else None,
            "anchor_strongest_fraction_deep": (float(np.mean([b["strongest_source"] <= 1 for b in deep]))
                                               if deep else None),
            "mean_previous_weight": float(np.mean([b["previous_weight"] for b in blocks])),
            "mean_normalized_entropy": float(np.mean([b["normalized_entropy"] for b in blocks[1:]])) if K > 1 else 0.0}


def format_topology_summary(summary: dict) -> str:
    """A short human-readable table of `topology_summary`'s output."""
    lines = [f"{'block':>5} {'strongest':>9} {'weight':>7} {'anchors':>7} {'previous':>8} {'H/log j':>7}"]
    for b in summary["blocks"]:
        lines.append(f"{b['block']:>5} {b['strongest_source']:>9} {b['strongest_weight']:>7.3f} "
                     f"{b['anchor_weight']:>7.3f} {b['previous_weight']:>8.3f} {b['normalized_entropy']:>7.3f}")
    if summary["mean_anchor_weight_deep"] is not None:
        lines.append(f"blocks 3..{summary['num_blocks']}: mean anchor weight {summary['mean_anchor_weight_deep']:.3f}, "
                     f"strongest source is an anchor in {100 * summary['anchor_strongest_fraction_deep']:.0f}%")
    lines.append(f"mean weight on the previous block {summary['mean_previous_weight']:.3f}, "
                 f"mean normalised entropy {summary['mean_normalized_entropy']:.3f}")
    return "\n".join(lines)


def prune_topology(P, top_k: int | None = None, threshold: float | None = None) -> np.ndarray:
    """Keeps each block's strongest incoming edges, each row rescaled to its former sum: exactly one of
    top_k (ties to the lower source) or threshold (the weights >= it, else the row's strongest edge)."""
    if (top_k is None) == (threshold is None):
        raise UserError(f"prune needs exactly one of top_k or threshold, got top_k={top_k}, threshold={threshold}")
    if top_k is not None and top_k < 1:
        raise UserError(f"prune's top_k must be at least 1, got {top_k}")
    if threshold is not None and not 0 <= threshold <= 1:
        raise UserError(f"prune's threshold is an edge weight in [0, 1], got {threshold}")
    P = square_topology(P)
    out = np.zeros_like(P)
    for j in range(P.shape[0]):
        row = P[j, : j + 1]
        total = row.sum()
        if total == 0:
            continue
        order = np.argsort(-row, kind="stable")
        keep = order[:top_k] if top_k is not None else (np.nonzero(row >= threshold)[0] if (row >= threshold).any()
                                                         else order[:1])
        out[j, keep] = row[keep] * (total / row[keep].sum())
    return out


def write_topology(path: str | Path, P, **extra) -> Path:
    """A topology.json that `model.topology=frozen model.topology_path=PATH` trains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_topology_json(path, torch.as_tensor(square_topology(P)), **extra)
    return path


def tsallis_entropy(P: torch.Tensor, q: float = 2.0) -> torch.Tensor:
    """Mean Tsallis entropy S_q(p) = (1 - sum_i p_i^q) / (q - 1) (q = 1: Shannon's) of the incoming weights
    p = P[j, 0..j] of blocks 2..K, differentiable; q = 2 keeps a finite gradient as weights reach 0. Added
    to the loss, it pushes rows toward few edges."""
    if not q > 0:
        raise UserError(f"the Tsallis entropy index q must be positive, got {q}")
    rows = P.tril()[1:]  # (anything above the diagonal is no edge)
    if q == 1:
        entropy = -(rows * torch.log(rows.clamp_min(1e-30))).sum(dim=1)
    else:
        entropy = (1.0 - rows.pow(q).sum(dim=1)) / (q - 1.0)
    return entropy.mean()


def topology_entropy(topology: ResidualTopology, q: float = 2.0) -> torch.Tensor:
    """`tsallis_entropy` of a topology's incoming weights, whose rows must be distributions (`incoming_softmax`)."""
    return tsallis_entropy(topology.probabilities(), q)
