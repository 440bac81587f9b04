"""The residual-topology interface: the module that owns the loop over the transformer blocks.
`forward(h0, blocks, c)` runs the trunk; `probabilities()` is the (K, K) matrix whose row j holds block
j+1's incoming weights over sources i = 0..j (h_0, then the blocks' outputs): the skip sum added *on top
of* each block's own residual adds (`mode="add"`, the official form; a plain DiT is the zero matrix), or
in place of the block's residual (`mode="replace"`: h_j = B_j(h_{j-1}) - h_{j-1} + sum_i P[j-1, i] h_i).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ...errors import MissingFileError, UserError
from .aggregation import StackedPlan, StackedTrunk, _StackedNode, aggregation_kernels, check_aggregation_kernel


class TopologyNotDefined(ValueError):
    """Raised by `probabilities()` of a scheme with no (K, K) block-to-block matrix (e.g. HC / mHC)."""


class ResidualTopology(nn.Module):
    """Subclasses override `forward` and `probabilities` and call every block (or the unit they wire
    around it) through `run_block`, so activation checkpointing works with all."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks
        self.grad_checkpointing = False
        # state_hook(k, z_k): z_0 = h_0, z_k the state after block k (the trunk's output for k = K). None in training.
        self.state_hook: Callable[[int, torch.Tensor], None] | None = None
        self.takes_time_embedding = False  # True: forward(h0, blocks, c, t_emb) also takes the timestep embedding

    def routing_parameters(self) -> list[nn.Parameter]:
        """What the trainer's topology learning rate, warmup and weight decay apply to (default: all)."""
        return list(self.parameters())

    def emit_state(self, k: int, z: torch.Tensor) -> None:
        if self.state_hook is not None:
            self.state_hook(k, z)

    def run_block(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """`fn(*args)`, its activations recomputed in the backward if gradient checkpointing is on."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def enable_topk(self, topk: int) -> None:
        """Sparse routing (model.topology_topk): only ANCRe keeps each block's strongest edges."""
        raise UserError(f"topology_topk={topk} applies to topology ancre only, not {type(self).__name__}; "
                        "use topology_topk=0")

    def check_blocks(self, blocks: Sequence[nn.Module]) -> None:
        if len(blocks) != self.num_blocks:
            raise ValueError(f"topology was built for {self.num_blocks} blocks, got {len(blocks)}")

    @contextlib.contextmanager
    def exact_state_gradients(self) -> Iterator[None]:
        """While on, a gradient with respect to a state given to `state_hook` is its whole gradient."""
        yield

    def probabilities(self) -> torch.Tensor:
        raise NotImplementedError


class CascadedTopology(ResidualTopology):
    """Plain DiT: h_j = B_j(h_{j-1}); each block keeps its own two residual adds."""

    def forward(self, h0, blocks, c):
        h = h0
        self.emit_state(0, h)
        for k, block in enumerate(blocks, start=1):
            h = self.run_block(block, h, c)
            self.emit_state(k, h)
        return h

    def probabilities(self) -> torch.Tensor:
        return torch.zeros(self.num_blocks, self.num_blocks)


class WeightedHistoryTopology(ResidualTopology):
    """h_j = B_j(h_{j-1}) + sum_{i<j} P[j-1, i] h_i, P = `probabilities()`, over the sources `edges[j-1]`.
    In eager mode each sum is a `_StackedNode` over a stacked history (aggregation.py); under torch.compile
    the plain `addcmul` chain, which the compiler fuses."""

    MODES = ("add", "replace")
    # True: the plain addcmul chain in eager mode too (inside `exact_state_gradients`; the tests' reference).
    use_chain = False

    def __init__(self, num_blocks: int, edges: list[list[int]] | None = None, mode: str = "add"):
        super().__init__(num_blocks)
        self.mode = mode
        self.history_dtype = torch.float32  # of the kept history under bf16 autocast (the stream keeps its own)
        self.aggregation_kernel = "torch"  # the eager stacked sums' kernels (aggregation.py, AGGREGATION_KERNELS)
        self.set_edges(edges if edges is not None else [list(range(j + 1)) for j in range(num_blocks)])

    def set_edges(self, edges: list[list[int]]) -> None:
        """The sources each block reads (`edges[j]` for block j+1)."""
        if self.mode == "replace":  # every block subtracts its own input: the previous source is always an edge
            edges = [sorted(set(e) | {j}) for j, e in enumerate(edges)]
        self.edges = [list(e) for e in edges]
        self._stacked_plan = StackedPlan(self.edges)
        # True at each edge, on the model's device: the backward masks the weights' gradient with it every step.
        mask = torch.tensor([[i in e for i in range(self.num_blocks)] for e in self.edges], dtype=torch.bool)
        self.register_buffer("edge_mask", mask.to(self.edge_mask.device) if hasattr(self, "edge_mask") else mask,
                             persistent=False)

    @contextlib.contextmanager
    def exact_state_gradients(self) -> Iterator[None]:
        """The plain chain meanwhile: the stacked backward adds the later reads of a history tensor to the
        gradient of the node that made it, which autograd never sees reach the state."""
        chain, self.use_chain = self.use_chain, True
        try:
            yield
        finally:
            self.use_chain = chain

    def mixing_weights(self) -> torch.Tensor:
        """P (add), or P minus the identity (replace: the block's own residual h_{j-1} is taken back out)."""
        weights = self.probabilities()
        if self.mode == "replace":
            weights = weights - torch.eye(self.num_blocks, dtype=weights.dtype, device=weights.device)
        return weights

    def forward(self, h0, blocks, c):
        self.check_blocks(blocks)
        weights = self.mixing_weights()
        # The history kept in bf16 only under bf16 autocast (and a stream not in bf16 already).
        device = h0.device.type
        bf16 = (self.history_dtype == torch.bfloat16 and torch.is_autocast_enabled(device)
                and torch.get_autocast_dtype(device) == torch.bfloat16 and h0.dtype != torch.bfloat16)
        cast = torch.bfloat16 if bf16 else None
        h = h0
        self.emit_state(0, h)
        if self.use_chain or torch.compiler.is_compiling():
            history = [h0 if cast is None else h0.to(cast)]
            for j, block in enumerate(blocks):
                h = self.run_block(block, h, c)
                for i in self.edges[j]:
                    h = torch.addcmul(h, history[i], weights[j, i])
                history.append(h if cast is None else h.to(cast))
                self.emit_state(j + 1, h)
            return h
        kernels = aggregation_kernels(self.aggregation_kernel, h0.device)
        trunk = StackedTrunk(self._stacked_plan, self.edge_mask, h0, cast or h0.dtype, kernels)
        for j, block in enumerate(blocks):  # node 0 also takes h_0 as an input, for its gradient
            h = _StackedNode.apply(self.run_block(block, h, c), weights, h0 if j == 0 else None, trunk, j)
            self.emit_state(j + 1, h)
        return h


class FixedTopology(WeightedHistoryTopology):
    """A frozen matrix of edge weights (a buffer, never trained); zero edges are skipped."""

    def __init__(self, weights: torch.Tensor, mode: str = "add"):
        weights = torch.as_tensor(weights, dtype=torch.float32)
        K = weights.shape[0]
        if weights.shape != (K, K) or torch.triu(weights, diagonal=1).abs().sum() > 0:
            raise UserError("a fixed topology needs a lower-triangular (K, K) matrix, "
                            f"got shape {tuple(weights.shape)}")
        edges = [[i for i in range(j + 1) if weights[j, i] != 0] for j in range(K)]
        super().__init__(K, edges, mode)
        self.register_buffer("weights", weights.clone())

    def probabilities(self) -> torch.Tensor:
        return self.weights


# model.history_dtype: the dtype of a weighted-history topology's kept history under bf16 autocast.
HISTORY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def configure_aggregation(topology: ResidualTopology, history_dtype: str = "float32", topk: int = 0,
                          kernel: str = "torch") -> None:
    """Applies model.history_dtype, model.aggregation_kernel (weighted histories) and model.topology_topk."""
    if history_dtype not in HISTORY_DTYPES:
        raise UserError(f"unknown history_dtype {history_dtype!r}; choose one of {', '.join(HISTORY_DTYPES)}")
    check_aggregation_kernel(kernel)
    if isinstance(topology, WeightedHistoryTopology):
        topology.history_dtype = HISTORY_DTYPES[history_dtype]
        topology.aggregation_kernel = kernel
    if topk:
        topology.enable_topk(topk)


def save_topology_json(path: str | Path, probabilities: torch.Tensor, **extra) -> None:
    """Writes P (K, K) as JSON; `frozen` topologies and the analysis tools read it back."""
    P = probabilities.detach().float().cpu()
    Path(path).write_text(json.dumps({"num_blocks": P.shape[0], "probabilities": P.tolist(), **extra}, indent=1))


def load_topology_json(path: str | Path) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"topology file {path} not found; pass the topology.json written at a checkpoint")
    try:
        P = torch.tensor(json.loads(path.read_text())["probabilities"], dtype=torch.float32)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path} is not a topology JSON with a 'probabilities' matrix ({err})") from None
    if not torch.isfinite(P).all():
        raise UserError(f"{path} holds non-finite weights (NaN or infinity: written by a run that diverged?); "
                        "pass the topology.json of a checkpoint from before it")
    return P
