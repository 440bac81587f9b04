"""The residual-topology interface: who owns the loop over the transformer blocks.

Every topology implements `trunk(h0, blocks, c) -> hK` (its `forward`) and `probabilities()`,
the (K, K) matrix whose row j holds the weights of block j+1's incoming edges over sources
i = 0..j (source 0 is the embedding h_0, source i the output of block i), zeros above the
diagonal. These are the weights of the skip sum added to each block's output *on top of* the
block's own two residual adds (PAPER.md), so a plain DiT ("cascaded") is the zero matrix, and a
one-hot "previous node" matrix gives h_j = B_j(h_{j-1}) + h_{j-1}.

This module holds the interface and the topologies with no learned weights (cascaded, a fixed
matrix); ANCRe and its ablations live in `ancre.py`, the peer schemes in `peers.py`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ...errors import MissingFileError, UserError


class TopologyNotDefined(ValueError):
    """The scheme has no (K, K) block-to-block weight matrix (e.g. n-stream HC / mHC).

    Raised by `probabilities()`; code that draws or logs topologies catches it and skips them.
    """


class ResidualTopology(nn.Module):
    """Base class: owns the loop over blocks. Subclasses override `forward` and `probabilities`,
    and call every block (or the unit they wire around it) through `run_block`, so activation
    checkpointing (`DiT.set_grad_checkpointing`) works with every topology."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks
        self.grad_checkpointing = False

    def run_block(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """`fn(*args)`; with gradient checkpointing on (and autograd recording), its activations
        are recomputed in the backward pass instead of kept: only its inputs stay in memory."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def check_blocks(self, blocks: Sequence[nn.Module]) -> None:
        if len(blocks) != self.num_blocks:
            raise ValueError(f"topology was built for {self.num_blocks} blocks, got {len(blocks)}")

    def forward(self, h0: torch.Tensor, blocks: Sequence[nn.Module], c: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def probabilities(self) -> torch.Tensor:
        raise NotImplementedError


class CascadedTopology(ResidualTopology):
    """Plain DiT: h_j = B_j(h_{j-1}); each block keeps its own two residual adds."""

    def forward(self, h0, blocks, c):
        h = h0
        for block in blocks:
            h = self.run_block(block, h, c)
        return h

    def probabilities(self) -> torch.Tensor:
        return torch.zeros(self.num_blocks, self.num_blocks)


class WeightedHistoryTopology(ResidualTopology):
    """h_j = B_j(h_{j-1}) + sum_{i<j} P[j-1, i] h_i, with P given by `probabilities()`.

    The weighted sum is a running sum over the kept history list (no stacked (K, ...) tensor), so
    activation memory matches the cascaded model. `edges[j]` lists the sources that can carry a
    non-zero weight into block j+1, so fixed sparse layouts skip their zero edges entirely.
    In eager mode the sum of each block is one `_WeightedSum` (a fused autograd function whose
    backward routes the history gradients itself, see `_RoutingPlan`); under torch.compile it is
    the plain `addcmul` chain, which the compiler fuses itself.
    """

    fused_aggregation = True  # False: the addcmul chain in eager mode too (benchmarks and pinned tests compare both)
    route_gradients = True  # False: each edge hands its source its own gradient (the form before routing; benchmarks)

    def __init__(self, num_blocks: int, edges: list[list[int]] | None = None):
        super().__init__(num_blocks)
        self.edges = edges if edges is not None else [list(range(j + 1)) for j in range(num_blocks)]
        # How each block's weights are read from its row of P, decided once: a contiguous run of
        # sources is a slice (a view), anything else an index list (a gather).
        self._row_selectors = [None if not e else slice(e[0], e[-1] + 1) if e == list(range(e[0], e[-1] + 1)) else e
                               for e in self.edges]
        self._routing_plan = _RoutingPlan(self.edges)

    def forward(self, h0, blocks, c):
        self.check_blocks(blocks)
        weights = self.probabilities()
        fused = self.fused_aggregation and not torch.compiler.is_compiling()
        routing = (_GradientRouting(self._routing_plan) if fused and self.route_gradients and torch.is_grad_enabled()
                   else None)
        history = [h0]
        h = h0
        for j, block in enumerate(blocks):
            out = self.run_block(block, h, c)
            edges = self.edges[j]
            if fused and edges:
                out = weighted_sum(out, weights[j, self._row_selectors[j]], [history[i] for i in edges], routing, j)
            else:
                for i in edges:
                    out = torch.addcmul(out, history[i], weights[j, i])
            h = out
            history.append(h)
        return h


class _RoutingPlan:
    """Which aggregation node hands each history tensor its skip-sum gradient (fixed by `edges`).

    Node j (the weighted sum of block j+1, output h_{j+1}) reads the sources `edges[j]`. Autograd
    would give each read its own product grad * w and then add the products up per source: a
    fresh tensor and three passes over it per edge. Instead every read but one *defers*: it adds
    w * grad in place into one accumulator per source, which reaches autograd once:
      - h_i made by node i-1: node i-1 *absorbs* it, adding it to the gradient of its own output
        (autograd runs node i-1 after every node that reads h_i, since they take h_i as input);
      - otherwise (h_0, or an h_i that no node made): its earliest reader *collects* it and returns
        it as that source's gradient (every later reader depends on that reader's output through
        the blocks, so autograd runs it last).
    """

    DEFER, COLLECT = 0, 1

    def __init__(self, edges: list[list[int]]):
        earliest_reader: dict[int, int] = {}
        for j, sources in enumerate(edges):
            for i in sources:
                earliest_reader.setdefault(i, j)
        absorbed = {i for i in earliest_reader if i >= 1 and edges[i - 1]}
        self.absorbs = [j + 1 in absorbed for j in range(len(edges))]
        self.modes = [[self.DEFER if i in absorbed or earliest_reader[i] != j else self.COLLECT for i in sources]
                      for j, sources in enumerate(edges)]
        self.edges = edges


class _GradientRouting:
    """One forward's accumulators of deferred history gradients, keyed by history index."""

    def __init__(self, plan: _RoutingPlan):
        self.plan = plan
        self.pending: dict[int, torch.Tensor] = {}

    def absorb(self, j: int, grad: torch.Tensor) -> torch.Tensor:
        """Node j's full output gradient: what autograd brought plus the deferred skip-sum reads."""
        acc = self.pending.pop(j + 1, None) if self.plan.absorbs[j] else None
        if acc is None:
            return grad
        return acc.add_(grad) if acc.dtype == grad.dtype else acc + grad

    def defer(self, i: int, grad: torch.Tensor, weight: torch.Tensor) -> None:
        acc = self.pending.get(i)
        if acc is None:
            self.pending[i] = grad * weight
        else:
            acc.addcmul_(grad, weight)

    def collect(self, i: int, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        acc = self.pending.pop(i, None)
        return grad * weight if acc is None else acc.addcmul_(grad, weight)


class _WeightedSum(torch.autograd.Function):
    """out + sum_i w[i] * sources[i], accumulated in place into one new tensor.

    Why by hand: autograd's backward of an addcmul chain allocates, per edge, the product
    grad * h_i, its sum (logit gradient) and grad * w_i (source gradient), and then adds the
    source gradients up per history tensor. Here the logit gradients are dot products (no
    temporary) and the source gradients go through `_GradientRouting` (one accumulator per history
    tensor, updated in place). Equal to the chain within fp32 rounding (tests/test_grad_checkpointing.py).
    With `routing` None (no autograd recording, or a lone call) every source gets its own gradient.
    """

    @staticmethod
    def forward(ctx, out, weights, routing, node, *sources):
        result = torch.addcmul(out, sources[0], weights[0])
        dtype = result.dtype
        for s in sources[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        result = result.to(dtype)  # what the chain of out-of-place addcmuls would return
        for i in range(1, len(sources)):
            result.addcmul_(sources[i], weights[i])
        ctx.save_for_backward(weights, *sources)
        ctx.routing, ctx.node = routing, node
        return result

    @staticmethod
    @once_differentiable  # the in-place accumulators are not themselves differentiable
    def backward(ctx, grad):
        weights, *sources = ctx.saved_tensors
        routing, j = ctx.routing, ctx.node
        if routing is not None:
            grad = routing.absorb(j, grad)
        grad_weights = None
        if ctx.needs_input_grad[1]:
            flat = grad.reshape(-1)
            grad_weights = torch.stack([torch.dot(flat, s.reshape(-1)) if s.dtype == flat.dtype
                                        else (flat.float() * s.reshape(-1).float()).sum()
                                        for s in sources]).to(weights.dtype)
        grad_sources = []
        for k in range(len(sources)):
            if not ctx.needs_input_grad[4 + k]:
                grad_sources.append(None)
            elif routing is None:
                grad_sources.append(grad * weights[k])
            elif routing.plan.modes[j][k] == _RoutingPlan.COLLECT:
                grad_sources.append(routing.collect(routing.plan.edges[j][k], grad, weights[k]))
            else:
                routing.defer(routing.plan.edges[j][k], grad, weights[k])
                grad_sources.append(None)
        return grad, grad_weights, None, None, *grad_sources


def weighted_sum(out: torch.Tensor, weights: torch.Tensor, sources: Sequence[torch.Tensor],
                 routing: _GradientRouting | None = None, node: int = 0) -> torch.Tensor:
    """`out + sum_i weights[i] * sources[i]` (weights a 1-d tensor, one per source), fused. Inside a
    trunk, `routing` and `node` (the block index) let each source's gradient be accumulated in place
    across blocks instead of once per edge."""
    return _WeightedSum.apply(out, weights, routing, node, *sources)


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

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "FixedTopology":
        """Rebuilds the topology from its own state dict (the matrix travels in `weights`)."""
        return cls(state["weights"])

    def probabilities(self) -> torch.Tensor:
        return self.weights


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
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path} is not a topology JSON with a 'probabilities' matrix ({err})") from None
