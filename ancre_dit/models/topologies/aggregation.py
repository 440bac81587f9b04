"""ANCRe's aggregation in eager mode, stacked: the history in one store, one product per block forward
and per source backward, the weights' gradient one Gram product. By hand: autograd's backward of the plain
`addcmul` chain allocates grad * h_i, its sum and grad * w_i per edge. torch.compile fuses that chain
itself, so this runs outside it; on CUDA the sums and the Gram product can be Triton kernels.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch
from torch.autograd.function import once_differentiable

from ...errors import UserError

# model.aggregation_kernel: auto = the Triton kernels on CUDA tensors if triton is installed; triton = the
# same, triton required (and a CUDA device to train on); torch (default) = never. On CPU, meta and under
# torch.compile the torch ops run, except triton under Triton's interpreter on CPU tensors (the tests).
AGGREGATION_KERNELS = ("auto", "triton", "torch")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET, read as Triton reads it): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def check_aggregation_kernel(choice: str, cuda: bool | None = None) -> None:
    """A UserError if `choice` is unknown, or is triton without the package, or with `cuda` False (the run
    has no CUDA device) outside Triton's interpreter."""
    if choice not in AGGREGATION_KERNELS:
        raise UserError(f"unknown aggregation_kernel {choice!r}; choose one of {', '.join(AGGREGATION_KERNELS)}")
    if choice != "triton":
        return
    if not triton_installed():
        raise UserError("aggregation_kernel=triton needs the triton package (pip install 'ancre-dit[triton]'); "
                        "or use aggregation_kernel=torch")
    if cuda is False and not triton_interpreting():
        raise UserError("aggregation_kernel=triton runs its kernels on a CUDA device and none is in use; "
                        "use aggregation_kernel=torch")


def aggregation_kernels(choice: str, device: torch.device) -> ModuleType | None:
    """The Triton kernels module if a forward on `device` runs them (see AGGREGATION_KERNELS), else None."""
    runs_there = device.type == "cuda" or (choice == "triton" and device.type == "cpu" and triton_interpreting())
    if choice == "torch" or not runs_there or (choice == "auto" and not triton_installed()):
        return None
    check_aggregation_kernel(choice)  # triton without the package: the error that names the extra
    return importlib.import_module(".aggregation_triton", __package__)


class StackedPlan:
    """What the stacked aggregation needs of `edges`: each source's readers, and index tensors per device.
    A block that reads no source passes its output through."""

    def __init__(self, edges: list[list[int]]):
        self.edges = edges
        self.readers = [[r for r, e in enumerate(edges) if i in e] for i in range(len(edges))]  # readers of source i
        self._indices: dict[tuple, torch.Tensor] = {}

    def device_indices(self, indices: list[int], device: torch.device) -> torch.Tensor:
        """`indices` as an int32 tensor on `device`, made once (the kernels read their rows from it)."""
        key = (tuple(indices), str(device))
        if key not in self._indices:
            self._indices[key] = torch.tensor(indices, dtype=torch.int32, device=device)
        return self._indices[key]


def _row_alias(store: torch.Tensor, k: int, shape: torch.Size) -> torch.Tensor:
    """Row k of `store` as a tensor of its own: same memory, but its own version counter, so writing
    the next rows does not look to autograd like a change of a tensor some block saved."""
    row = torch.empty(0, dtype=store.dtype, device=store.device)
    strides = torch.empty(shape, device="meta").stride()
    return row.set_(store.untyped_storage(), store.storage_offset() + k * store.shape[1], shape, strides)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as maximal runs of consecutive ones: [0, 1, 4] -> [(0, 2), (4, 5)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _sum_rows(kernels: ModuleType | None, plan: StackedPlan, into: torch.Tensor, base: torch.Tensor | None,
              rows: torch.Tensor, indices: list[int], weights: torch.Tensor,
              copy_to: torch.Tensor | None = None) -> None:
    """into = base + sum_i weights[i] * rows[i] over `indices` (flat; no base: zero), by the Triton kernels
    if given; `copy_to` gets the same sum. The torch ops: one matrix-vector product per run of consecutive
    rows (slices: a gather by a Python list would copy it to the device), one addcmul per row across dtypes."""
    if kernels is not None:
        kernels.sum_rows(into, base, rows, plan.device_indices(indices, into.device), weights, copy_to=copy_to)
        return
    base = None if base is None else base.reshape(-1).to(into.dtype)
    if indices and rows.dtype == into.dtype:
        w = weights.to(into.dtype)
        for n, (a, b) in enumerate(_runs(indices)):
            block, part = rows[a:b].t(), w[a:b]
            if n:
                into.addmv_(block, part)
            elif base is None:
                torch.mv(block, part, out=into)
            else:
                torch.addmv(base, block, part, out=into)
    else:
        if base is None:
            into.zero_()
        else:
            into.copy_(base)
        for i in indices:
            into.addcmul_(rows[i], weights[i])
    if copy_to is not None:
        copy_to.copy_(into)


class StackedTrunk:
    """One forward's history store (h_0 as row 0) and, in the backward, the nodes' output gradients."""

    def __init__(self, plan: StackedPlan, edge_mask: torch.Tensor, h0: torch.Tensor, dtype: torch.dtype,
                 kernels: ModuleType | None = None):
        self.plan, self.edge_mask, self.shape, self.kernels = plan, edge_mask, h0.shape, kernels  # None: torch ops
        self.store = torch.empty((len(plan.edges), h0.numel()), dtype=dtype, device=h0.device)
        self.store[0].copy_(h0.detach().reshape(-1))
        self.grads: torch.Tensor | None = None
        self.done: list[bool] = []


class _StackedNode(torch.autograd.Function):
    """h_{j+1} = out + sum_i w[j, i] h_i over node j's sources, `StackedTrunk` holding the history. Node j's
    backward returns what autograd brought plus the later nodes' reads of h_{j+1}; node 0's, which runs
    last, also the weight matrix's gradient (the Gram product) and h_0's."""

    @staticmethod
    def forward(ctx, out, weights, h0, trunk: StackedTrunk, j: int):
        store, edges = trunk.store, trunk.plan.edges[j]
        K = store.shape[0]
        dtype = torch.promote_types(out.dtype, store.dtype)
        in_store = j < K - 1 and dtype == store.dtype  # the output is itself the store's next row
        result = _row_alias(store, j + 1, out.shape) if in_store else torch.empty(out.shape, dtype=dtype,
                                                                                  device=out.device)
        copy = j < K - 1 and not in_store  # e.g. a bf16 history under a fp32 stream
        kernels = trunk.kernels if trunk.kernels is not None and trunk.kernels.supports(out, store, weights) else None
        _sum_rows(kernels, trunk.plan, result.view(-1), out, store, edges, weights[j], store[j + 1] if copy else None)
        ctx.trunk, ctx.j, ctx.weights = trunk, j, weights.detach()
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        trunk, j, W = ctx.trunk, ctx.j, ctx.weights
        plan, K = trunk.plan, len(trunk.plan.edges)
        if trunk.grads is None:  # the first node autograd reaches
            trunk.grads = torch.empty((K, grad.numel()), dtype=grad.dtype, device=grad.device)
            trunk.done = [False] * K
        grads = trunk.grads
        # the nodes that read h_{j+1} and ran (a loss on an inner state leaves the later ones out)
        readers = [r for r in plan.readers[j + 1] if trunk.done[r]] if j + 1 < K else []
        G = grads[j]
        kernels = trunk.kernels if trunk.kernels is not None and trunk.kernels.supports(grad, grads, W) else None
        column = W[:, j + 1] if j + 1 < K else W[:, 0]  # (the last node has no readers: any column)
        _sum_rows(kernels, plan, G, grad, grads, readers, column)
        trunk.done[j] = True
        grad_weights = grad_h0 = None
        if j == 0:
            if ctx.needs_input_grad[2]:
                readers0 = [r for r in plan.readers[0] if trunk.done[r]]
                grad_h0 = torch.empty(trunk.shape, dtype=G.dtype, device=G.device)
                _sum_rows(kernels, plan, grad_h0.view(-1), None, grads, readers0, W[:, 0])
            if ctx.needs_input_grad[1]:
                gram = kernels.gram(grads, trunk.store, W.dtype) if kernels is not None else None
                if gram is None:
                    gram = _gram(grads, trunk.store, W.dtype)
                kept = trunk.edge_mask
                if not all(trunk.done):  # a loss on an inner state: the later nodes' rows hold no gradient
                    kept = kept & torch.tensor(trunk.done, device=W.device)[:, None]
                grad_weights = gram.masked_fill(~kept, 0)
            trunk.grads, trunk.done = None, []  # (a second backward of a kept graph starts afresh)
        return G.view(grad.shape), grad_weights, grad_h0, None, None


def _gram(grads: torch.Tensor, store: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 20) -> torch.Tensor:
    """(K, K) matrix of <grads[r], h_i> (in chunks when the dtypes differ: no full-size upcast copy)."""
    if store.dtype == grads.dtype:
        return (grads @ store.t()).to(dtype)
    out = torch.zeros(grads.shape[0], store.shape[0], dtype=grads.dtype, device=grads.device)
    for s in range(0, grads.shape[1], chunk):
        out += grads[:, s:s + chunk] @ store[:, s:s + chunk].t().to(grads.dtype)
    return out.to(dtype)
