"""ANCRe (Zhang et al., arXiv 2602.09009) and its paper's ablations on `WeightedHistoryTopology`'s trunk
(base.py); also registers the plain DiT ("cascaded") and "frozen"."""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import StrictStr

from ...errors import UserError
from .base import CascadedTopology, FixedTopology, ResidualTopology, WeightedHistoryTopology, load_topology_json
from .registry import NonNegativeFloat, PositiveFloat, TopologyOption, register_topology


# The ANCRe family's options, the one place their defaults and ranges are written (tau 0 would train NaN).
TAU = {"tau": TopologyOption(PositiveFloat, 0.01, "softmax temperature of the logits (0.01 in the paper)")}
MODE = {"ancre_mode": TopologyOption(Literal[WeightedHistoryTopology.MODES], "add", "add: the skip sum on top of "
                                     "each block's own residual (the official form); replace: the convex mix in "
                                     "place of it")}
START = {"topology_init": TopologyOption(Literal["uniform", "first", "previous"], "uniform",
                                         "starting topology: uniform (zero logits, the official start), first "
                                         "(favours h_0, the anchor) or previous (favours h_{j-1})"),
         "topology_init_gap": TopologyOption(NonNegativeFloat, 4.0, "logit gap of the favoured source, in units of "
                                             "tau (its weight is e^gap times each other source's)")}


class _PerBlockLogits(WeightedHistoryTopology):
    """Block j+1's j+1 coefficients as `logits.j` (K(K+1)/2 in all), the official `ancre.shortcut_params.j`."""

    def __init__(self, num_blocks: int, frozen_block: int | None = None, mode: str = "add"):
        super().__init__(num_blocks, mode=mode)
        self.logits = nn.ParameterList([nn.Parameter(torch.zeros(j + 1)) for j in range(num_blocks)])
        if frozen_block is not None:
            self.logits[frozen_block].requires_grad_(False)

    def logit_matrix(self, fill: float) -> torch.Tensor:
        """(K, K) matrix of the stored coefficients, `fill` above the diagonal."""
        K = self.num_blocks
        return torch.stack([F.pad(self.logits[j], (0, K - 1 - j), value=fill) for j in range(K)])


class ANCReTopology(_PerBlockLogits):
    """ANCRe: p_{.j} = softmax_i(c_ij / tau) over the incoming edges of each block (rows sum to 1).

    Logits start at zero (uniform 1/j) or favour source 0 (`init` first) / j-1 (previous) by `init_gap`
    taus. Block 1's single logit is frozen (its softmax is 1); tau is a buffer, so checkpoints carry it.
    """

    softmax_dim = 1  # over sources i: the incoming edges of each block
    frozen_block: int | None = 0

    def __init__(self, num_blocks: int, tau: float = TAU["tau"].default, mode: str = "add", init: str = "uniform",
                 init_gap: float = START["topology_init_gap"].default):
        super().__init__(num_blocks, frozen_block=self.frozen_block, mode=mode)
        self.register_buffer("tau", torch.tensor(float(tau)))
        if init != "uniform":
            with torch.no_grad():
                for j, logits in enumerate(self.logits):
                    logits[0 if init == "first" else j] = init_gap * float(tau)

    def probabilities(self) -> torch.Tensor:
        logits = self.logit_matrix(float("-inf"))
        if self.topk:  # a sparse topology: the softmax renormalised over the kept edges
            logits = logits.masked_fill(~self.kept, float("-inf"))
        return torch.softmax(logits / self.tau, dim=self.softmax_dim)

    # -- sparse ANCRe: dense until train.topology_sparsify_step, then the topk strongest incoming edges
    topk = 0

    def enable_topk(self, topk: int) -> None:
        """Makes `sparsify()` keep each block's `topk` strongest edges, in the buffer `kept` checkpoints carry."""
        if not 1 <= topk < self.num_blocks:
            raise UserError(f"topology_topk={topk} must be between 1 and {self.num_blocks - 1} (the deepest of the "
                            f"{self.num_blocks} blocks has {self.num_blocks} sources); lower it")
        self.topk = int(topk)
        self.register_buffer("kept", torch.tril(torch.ones(self.num_blocks, self.num_blocks, dtype=torch.bool)))

    @property
    def is_sparse(self) -> bool:
        return bool(self.topk) and int(self.kept.sum()) < self.num_blocks * (self.num_blocks + 1) // 2

    def sparsify(self, kept: torch.Tensor | None = None) -> None:
        """Keeps each block's `topk` strongest incoming edges (by weight; ties to the earlier source),
        or the edges of `kept` (another copy's mask, e.g. the training weights' for the EMA)."""
        if not self.topk:
            raise RuntimeError("sparsify() needs enable_topk() first")
        with torch.no_grad():
            if kept is None:
                P = self.probabilities().detach().cpu()
                # (the zeros above the diagonal sort after a row's own sources, which the tril drops anyway)
                order = torch.argsort(-P.tril(), dim=1, stable=True)[:, : self.topk]
                kept = torch.zeros_like(self.kept, device="cpu").scatter_(1, order, True).tril()
            self.kept.copy_(kept)
        self._edges_from_mask()

    def _edges_from_mask(self) -> None:
        self.set_edges([row.nonzero().flatten().tolist() for row in self.kept.cpu()])  # (kept is lower-triangular)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.topk:  # a checkpoint of a sparse run brings its kept edges: rewire to them
            self._edges_from_mask()

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, tau={self.tau.item():g}" + (f", topk={self.topk}" if self.topk else "")


class OutgoingANCReTopology(ANCReTopology):
    """Ablation: softmax over the *outgoing* edges of each source i (columns sum to 1). All logits
    train (h_{K-1} -> block K, its source's only outgoing edge, is 1 and gets no gradient)."""

    softmax_dim = 0  # over targets j: the outgoing edges of each source
    frozen_block = None
    enable_topk = ResidualTopology.enable_topk  # sparse routing keeps incoming edges: not for this softmax


class UnnormalizedTopology(_PerBlockLogits):
    """Ablation: free coefficients, no softmax, initialised to 1/j (the paper reports it diverges)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        with torch.no_grad():
            for j, p in enumerate(self.logits):
                p.fill_(1.0 / (j + 1))

    def probabilities(self) -> torch.Tensor:
        return self.logit_matrix(0.0)


class LearnableScalarsTopology(WeightedHistoryTopology):
    """Ablation: h_j = B_j(h_{j-1}) + a_j h_{j-1}, one learnable scalar per block, a_j = 1 at init."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, edges=[[j] for j in range(num_blocks)])
        self.scales = nn.Parameter(torch.ones(num_blocks))

    def probabilities(self) -> torch.Tensor:
        return torch.diag(self.scales)


def fixed_dense_weights(num_blocks: int) -> torch.Tensor:
    """Uniform 1/j over all incoming edges: ANCRe's initial topology, frozen."""
    return torch.tril(torch.ones(num_blocks, num_blocks)) / torch.arange(1, num_blocks + 1.0)[:, None]


def first_previous_weights(num_blocks: int) -> torch.Tensor:
    """Only h_0 -> j and h_{j-1} -> j, each weighted 1/2 (block 1 takes h_0 with weight 1)."""
    weights = torch.eye(num_blocks) / 2
    weights[:, 0] += 0.5
    return weights


# -- registry entries (in the order users see them listed) ---------------------------------------
register_topology("cascaded", summary="plain DiT")(lambda num_blocks, hidden_size: CascadedTopology(num_blocks))
register_topology("ancre", options={**TAU, **MODE, **START}, sparse=True, incoming_softmax=True,
                  summary="ANCRe: ingoing softmax over all earlier outputs, block 1's logit frozen")(
    lambda num_blocks, hidden_size, tau, ancre_mode, topology_init, topology_init_gap: ANCReTopology(
        num_blocks, tau, ancre_mode, topology_init, topology_init_gap))
register_topology("ancre-outgoing", options=TAU, summary="ablation: softmax over each source's outgoing edges")(
    lambda num_blocks, hidden_size, tau: OutgoingANCReTopology(num_blocks, tau))
register_topology("ancre-unnormalized", summary="ablation: free coefficients, initialised to 1/j")(
    lambda num_blocks, hidden_size: UnnormalizedTopology(num_blocks))
register_topology("learnable-scalars", summary="ablation: h_j = B_j(h_{j-1}) + a_j h_{j-1}, a_j = 1 at init")(
    lambda num_blocks, hidden_size: LearnableScalarsTopology(num_blocks))
# Frozen convex topologies: their mix is added (official) or replaces each block's residual.
register_topology("fixed-dense", options=MODE, summary="ablation: frozen uniform 1/j (ANCRe's start, never trained)")(
    lambda num_blocks, hidden_size, ancre_mode: FixedTopology(fixed_dense_weights(num_blocks), ancre_mode))
register_topology("first-previous", options=MODE, summary="ablation: fixed 1/2 on h_0 -> j and h_{j-1} -> j")(
    lambda num_blocks, hidden_size, ancre_mode: FixedTopology(first_previous_weights(num_blocks), ancre_mode))


def check_frozen(options: dict[str, Any]) -> None:
    if options["topology_path"] is None:
        raise UserError("topology 'frozen' needs topology_path=<topology.json of a trained run>")


PATH = {"topology_path": TopologyOption(StrictStr | None, None, "topology.json of a trained run", file=True)}


# restore: the frozen matrix travels in the state dict (its JSON may be gone), the mode in the options.
@register_topology("frozen", options={**PATH, **MODE}, check=check_frozen,
                   restore=lambda state, ancre_mode="add", **_: FixedTopology(state["weights"], ancre_mode),
                   summary="a topology loaded from a topology.json, never trained")
def build_frozen(num_blocks: int, hidden_size: int | None, topology_path: str, ancre_mode: str) -> ResidualTopology:
    weights = load_topology_json(topology_path)
    if weights.shape[0] != num_blocks:
        raise UserError(f"{topology_path} holds a {weights.shape[0]}-block topology, the model has {num_blocks} blocks")
    return FixedTopology(weights, ancre_mode)
