"""Residual topologies: who owns the loop over the transformer blocks.

Every topology implements one interface, `trunk(h0, blocks, c) -> hK` (its `forward`), and
`probabilities()`, the (K, K) matrix whose row j holds the weights of block j+1's incoming
edges over sources i = 0..j (source 0 is the embedding h_0, source i the output of block i),
zeros above the diagonal. These are the weights of the skip sum that ANCRe adds to each block's
output *on top of* the block's own two residual adds (PAPER.md), so a plain DiT ("cascaded") is
the zero matrix, and a one-hot "previous node" matrix gives h_j = B_j(h_{j-1}) + h_{j-1}.

ANCRe (Zhang et al., arXiv 2602.09009) and its ablations are written by hand here: no
library implements them. All history-based variants share one trunk that keeps the list of
earlier outputs and adds the weighted sum as a running sum (no stacked (K, ...) tensor), so
activation memory matches the cascaded model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..errors import MissingFileError, UserError

CASCADED = "cascaded"
ANCRE = "ancre"
# The paper's ablation variants (PAPER.md, ablation table).
ANCRE_OUTGOING = "ancre-outgoing"
ANCRE_UNNORMALIZED = "ancre-unnormalized"
FIXED_DENSE = "fixed-dense"
LEARNABLE_SCALARS = "learnable-scalars"
FIRST_PREVIOUS = "first-previous"
FROZEN = "frozen"
# Peer schemes, implemented in peers.py (imported lazily: peers.py imports this module).
DENSEFORMER = "denseformer"
HC = "hc"
HC_DYNAMIC = "hc-dynamic"
MHC = "mhc"
PEER_TOPOLOGIES = (DENSEFORMER, HC, HC_DYNAMIC, MHC)


class TopologyNotDefined(ValueError):
    """The scheme has no (K, K) block-to-block weight matrix (e.g. n-stream HC / mHC).

    Raised by `probabilities()`; code that draws or logs topologies catches it and skips them.
    """


class ResidualTopology(nn.Module):
    """Base class: owns the loop over blocks. Subclasses override `forward` and `probabilities`."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks

    def forward(self, h0: torch.Tensor, blocks: Sequence[nn.Module], c: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def probabilities(self) -> torch.Tensor:
        raise NotImplementedError


class CascadedTopology(ResidualTopology):
    """Plain DiT: h_j = B_j(h_{j-1}); each block keeps its own two residual adds."""

    def forward(self, h0, blocks, c):
        h = h0
        for block in blocks:
            h = block(h, c)
        return h

    def probabilities(self) -> torch.Tensor:
        return torch.zeros(self.num_blocks, self.num_blocks)


class WeightedHistoryTopology(ResidualTopology):
    """h_j = B_j(h_{j-1}) + sum_{i<j} P[j-1, i] h_i, with P given by `probabilities()`.

    `edges[j]` lists the sources that can carry a non-zero weight into block j+1, so fixed
    sparse layouts (first + previous, a frozen one-hot topology) skip their zero edges.
    """

    def __init__(self, num_blocks: int, edges: list[list[int]] | None = None):
        super().__init__(num_blocks)
        self.edges = edges if edges is not None else [list(range(j + 1)) for j in range(num_blocks)]

    def forward(self, h0, blocks, c):
        if len(blocks) != self.num_blocks:
            raise ValueError(f"topology was built for {self.num_blocks} blocks, got {len(blocks)}")
        weights = self.probabilities()
        history = [h0]
        h = h0
        for j, block in enumerate(blocks):
            out = block(h, c)
            for i in self.edges[j]:  # running sum: no stacked history tensor
                out = torch.addcmul(out, history[i], weights[j, i])
            h = out
            history.append(h)
        return h


class _PerBlockLogits(WeightedHistoryTopology):
    """Stores block j+1's j+1 incoming coefficients as `logits.j`: K(K+1)/2 scalars in all,
    the layout of the official ANCRe code (`ancre.shortcut_params.j`)."""

    def __init__(self, num_blocks: int, init: float = 0.0, frozen_block: int | None = None):
        super().__init__(num_blocks)
        self.logits = nn.ParameterList(
            [nn.Parameter(torch.full((j + 1,), float(init))) for j in range(num_blocks)]
        )
        if frozen_block is not None:
            self.logits[frozen_block].requires_grad_(False)

    def logit_matrix(self, fill: float) -> torch.Tensor:
        """(K, K) matrix of the stored coefficients, `fill` above the diagonal."""
        K = self.num_blocks
        rows = [F.pad(self.logits[j], (0, K - 1 - j), value=fill) for j in range(K)]
        return torch.stack(rows)


class ANCReTopology(_PerBlockLogits):
    """ANCRe: p_{.j} = softmax_i(c_ij / tau) over the incoming edges of each block (rows sum to 1).

    Logits start at zero (uniform 1/j); block 1's single logit is frozen since its softmax is 1
    whatever it holds. tau is stored as a buffer so a checkpoint carries the value it was trained with.
    """

    softmax_dim = 1  # over sources i: the incoming edges of each block
    frozen_block: int | None = 0

    def __init__(self, num_blocks: int, tau: float = 0.01):
        super().__init__(num_blocks, init=0.0, frozen_block=self.frozen_block)
        self.register_buffer("tau", torch.tensor(float(tau)))

    def probabilities(self) -> torch.Tensor:
        return torch.softmax(self.logit_matrix(float("-inf")) / self.tau, dim=self.softmax_dim)

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, tau={self.tau.item():g}"


class OutgoingANCReTopology(ANCReTopology):
    """Ablation: softmax over the *outgoing* edges of each source i (columns sum to 1).

    All K(K+1)/2 logits are trainable; the edge h_{K-1} -> block K is its source's only outgoing
    edge, so its weight is 1 and its logit never receives a gradient.
    """

    softmax_dim = 0  # over targets j: the outgoing edges of each source
    frozen_block = None


class UnnormalizedTopology(_PerBlockLogits):
    """Ablation: free learnable coefficients, no softmax, initialised to the uniform 1/j.
    The paper reports this diverges; it is here so that table can be rerun."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        with torch.no_grad():
            for j, p in enumerate(self.logits):
                p.fill_(1.0 / (j + 1))

    def probabilities(self) -> torch.Tensor:
        return self.logit_matrix(0.0)


class FixedTopology(WeightedHistoryTopology):
    """A frozen matrix of edge weights (a buffer, never trained); zero edges are skipped."""

    def __init__(self, weights: torch.Tensor):
        weights = torch.as_tensor(weights, dtype=torch.float32)
        K = weights.shape[0]
        if weights.shape != (K, K) or torch.triu(weights, diagonal=1).abs().sum() > 0:
            raise UserError(f"a fixed topology needs a lower-triangular (K, K) matrix, got shape {tuple(weights.shape)}")
        edges = [[i for i in range(j + 1) if weights[j, i] != 0] for j in range(K)]
        super().__init__(K, edges)
        self.register_buffer("weights", weights.clone())

    def probabilities(self) -> torch.Tensor:
        return self.weights


class LearnableScalarsTopology(WeightedHistoryTopology):
    """Ablation: h_j = B_j(h_{j-1}) + a_j h_{j-1}, one learnable scalar per block, a_j = 1 at init."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, edges=[[j] for j in range(num_blocks)])
        self.scales = nn.Parameter(torch.ones(num_blocks))

    def probabilities(self) -> torch.Tensor:
        return torch.diag(self.scales)


def fixed_dense_weights(num_blocks: int) -> torch.Tensor:
    """Uniform 1/j over all incoming edges: ANCRe's initial topology, frozen."""
    rows = torch.arange(1, num_blocks + 1, dtype=torch.float32)
    return torch.tril(torch.ones(num_blocks, num_blocks)) / rows[:, None]


def first_previous_weights(num_blocks: int) -> torch.Tensor:
    """Only h_0 -> j and h_{j-1} -> j, each weighted 1/2 (block 1 takes h_0 with weight 1)."""
    weights = torch.zeros(num_blocks, num_blocks)
    weights[0, 0] = 1.0
    for j in range(1, num_blocks):
        weights[j, 0] = weights[j, j] = 0.5
    return weights


def save_topology_json(path: str | Path, probabilities: torch.Tensor, **extra) -> None:
    """Writes P (K, K) as JSON; `frozen` topologies and the analysis tools read it back."""
    P = probabilities.detach().float().cpu()
    payload = {"num_blocks": P.shape[0], "probabilities": P.tolist(), **extra}
    Path(path).write_text(json.dumps(payload, indent=1))


def load_topology_json(path: str | Path) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"topology file {path} not found; pass the topology.json written at a checkpoint")
    try:
        payload = json.loads(path.read_text())
        return torch.tensor(payload["probabilities"], dtype=torch.float32)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a topology JSON with a 'probabilities' matrix ({err})") from None


TOPOLOGIES = (CASCADED, ANCRE, ANCRE_OUTGOING, ANCRE_UNNORMALIZED, FIXED_DENSE, LEARNABLE_SCALARS,
              FIRST_PREVIOUS, FROZEN) + PEER_TOPOLOGIES


def build_topology(name: str, num_blocks: int, tau: float = 0.01, topology_path: str | None = None,
                   hidden_size: int | None = None, hc_streams: int = 4, sinkhorn_iters: int = 20) -> ResidualTopology:
    """Name -> residual topology. `topology_path` is the JSON of P for `frozen`; `hidden_size`,
    `hc_streams` (n) and `sinkhorn_iters` are used by the peer schemes (peers.py)."""
    if name in PEER_TOPOLOGIES:
        from .peers import build_peer_topology
        return build_peer_topology(name, num_blocks, hidden_size, hc_streams, sinkhorn_iters)
    if name == CASCADED:
        return CascadedTopology(num_blocks)
    if name == ANCRE:
        return ANCReTopology(num_blocks, tau)
    if name == ANCRE_OUTGOING:
        return OutgoingANCReTopology(num_blocks, tau)
    if name == ANCRE_UNNORMALIZED:
        return UnnormalizedTopology(num_blocks)
    if name == FIXED_DENSE:
        return FixedTopology(fixed_dense_weights(num_blocks))
    if name == LEARNABLE_SCALARS:
        return LearnableScalarsTopology(num_blocks)
    if name == FIRST_PREVIOUS:
        return FixedTopology(first_previous_weights(num_blocks))
    if name == FROZEN:
        if topology_path is None:
            raise UserError("topology 'frozen' needs topology_path=<topology.json of a trained run>")
        weights = load_topology_json(topology_path)
        if weights.shape[0] != num_blocks:
            raise UserError(f"{topology_path} holds a {weights.shape[0]}-block topology, the model has {num_blocks} blocks")
        return FixedTopology(weights)
    raise UserError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}")
