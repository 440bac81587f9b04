"""ANCRe's aggregation in eager mode: the fused weighted sum of a block's history and the routing of
its gradients across blocks.

Written by hand: autograd's backward of the plain `addcmul` chain makes fresh per-edge temporaries
(see `_WeightedSum`), and no library offers a weighted history sum. Used by `WeightedHistoryTopology`
(base.py) outside torch.compile, which fuses the plain chain itself.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import once_differentiable


class RoutingPlan:
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


class GradientRouting:
    """One forward's accumulators of deferred history gradients, keyed by history index."""

    def __init__(self, plan: RoutingPlan):
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
    temporary) and the source gradients go through `GradientRouting` (one accumulator per history
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
            elif routing.plan.modes[j][k] == RoutingPlan.COLLECT:
                grad_sources.append(routing.collect(routing.plan.edges[j][k], grad, weights[k]))
            else:
                routing.defer(routing.plan.edges[j][k], grad, weights[k])
                grad_sources.append(None)
        return grad, grad_weights, None, None, *grad_sources


def weighted_sum(out: torch.Tensor, weights: torch.Tensor, sources: Sequence[torch.Tensor],
                 routing: GradientRouting | None = None, node: int = 0) -> torch.Tensor:
    """`out + sum_i weights[i] * sources[i]` (weights a 1-d tensor, one per source), fused. Inside a
    trunk, `routing` and `node` (the block index) let each source's gradient be accumulated in place
    across blocks instead of once per edge."""
    return _WeightedSum.apply(out, weights, routing, node, *sources)
