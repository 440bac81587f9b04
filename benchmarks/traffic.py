"""The bytes ANCRe's aggregation moves per training step: a model of the eager stacked form
(`ancre_dit.models.topologies.aggregation`, op by op) and of the floor any implementation needs,
counted in activation-sized passes (reads and writes of N = batch x tokens x width elements) by
dtype. Tensors smaller than an activation (the weights, their gradient) are left out.

The floor: forward, each edge's source read once, each block output read once and the new state
written once (and its history copy, when the history has its own dtype); backward, each edge's
reader gradient read once (the skip gradient of its source), each node's incoming gradient read and
its output gradient written once, and the weights' gradient one Gram pass over the K gradients and
the K history tensors. tests/test_traffic.py checks the stacked model against a dispatch-mode count
of the bytes the real ops touch. The Triton kernels (`aggregation_triton`, model.aggregation_kernel)
make one pass per sum whatever the dtypes, with the history copy written from the same pass.
"""
from __future__ import annotations

from collections import Counter

# HBM bandwidth (TB/s) of the GPUs we size for: the vendors' SXM figures.
BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "B200": 8.0}

Passes = dict[str, Counter]  # {"forward read": Counter({bytes per element: passes}), ...}


def _new() -> Passes:
    return {f"{phase} {kind}": Counter() for phase in ("forward", "backward") for kind in ("read", "write")}


def readers_of(edges: list[list[int]]) -> list[list[int]]:
    K = len(edges)
    return [[r for r in range(K) if i in edges[r]] for i in range(K)]


def _accumulate_passes(read: Counter, write: Counter, indices: list[int], rows: int, into: int,
                       base: bool = True) -> None:
    """The passes of one `_accumulate` over `indices` (`rows`, `into`: bytes per element of the rows
    read and of the sum; `base`: a base tensor is added, else the sum starts from zero)."""
    if indices and rows == into:  # one matrix-vector product per run of consecutive rows
        runs = sum(1 for k, i in enumerate(indices) if k == 0 or indices[k - 1] != i - 1)
        read[rows] += len(indices)
        read[into] += runs - (0 if base else 1)  # the base, then the running sum at each later run
        write[into] += runs
    else:  # the base copied (or zeroed), then one addcmul_ per row
        read[into] += (1 if base else 0) + len(indices)
        read[rows] += len(indices)
        write[into] += 1 + len(indices)


def stacked_passes(edges: list[list[int]], stream: int = 4, history: int = 4) -> Passes:
    """The passes the stacked aggregation makes over one full forward + backward (`stream` and
    `history`: bytes per element of the residual stream and of the kept history)."""
    K, p, readers = len(edges), _new(), readers_of(edges)
    fr, fw, br, bw = p["forward read"], p["forward write"], p["backward read"], p["backward write"]
    fr[stream] += 1; fw[history] += 1                    # h_0 into the store
    for j, e in enumerate(edges):
        _accumulate_passes(fr, fw, e, history, stream)
        if j < K - 1 and history != stream:             # the state's history copy
            fr[stream] += 1; fw[history] += 1
    for j in range(K):                                  # each node's output gradient
        _accumulate_passes(br, bw, readers[j + 1] if j + 1 < K else [], stream, stream)
    _accumulate_passes(br, bw, readers[0], stream, stream, base=False)  # h_0's gradient
    if history == stream:                               # the Gram product
        br[stream] += K; br[history] += K
    else:                                               # (in chunks: the history chunk upcast first)
        br[history] += K; bw[stream] += K; br[stream] += 2 * K
    return p


def triton_passes(edges: list[list[int]], stream: int = 4, history: int = 4) -> Passes:
    """The passes of the stacked aggregation with its Triton kernels: each sum reads its base and its
    rows once and writes its result (and the next history row, when the history has its own dtype)
    once; the Gram kernel reads every gradient and history row once."""
    K, p, readers = len(edges), _new(), readers_of(edges)
    fr, fw, br, bw = p["forward read"], p["forward write"], p["backward read"], p["backward write"]
    fr[stream] += 1; fw[history] += 1                    # h_0 into the store (a torch copy)
    for j, e in enumerate(edges):
        fr[history] += len(e); fr[stream] += 1; fw[stream] += 1
        if j < K - 1 and history != stream:
            fw[history] += 1
    for j in range(K):                                  # each node's output gradient
        br[stream] += 1 + (len(readers[j + 1]) if j + 1 < K else 0); bw[stream] += 1
    br[stream] += len(readers[0]); bw[stream] += 1      # h_0's gradient
    br[stream] += K; br[history] += K                   # the Gram product
    return p


def floor_passes(edges: list[list[int]], stream: int = 4, history: int = 4) -> Passes:
    """The least any aggregation of these edges moves (see the module docstring)."""
    K, p, readers = len(edges), _new(), readers_of(edges)
    E = sum(map(len, edges))
    p["forward read"][history] += E
    p["forward read"][stream] += K
    p["forward write"][stream] += K
    if history != stream:
        p["forward write"][history] += K
    p["backward read"][stream] += sum(len(r) for r in readers) + K + K  # reader gradients, incoming, Gram
    p["backward read"][history] += K
    p["backward write"][stream] += K + 1  # each node's output gradient, h_0's
    return p


def total_bytes(passes: Passes, elements: int) -> dict[str, int]:
    return {key: elements * sum(b * n for b, n in c.items()) for key, c in passes.items()}


def dense_edges(K: int, mode: str = "add") -> list[list[int]]:
    return [list(range(j + 1)) for j in range(K)]


def topk_edges(K: int, k: int, mode: str = "add") -> list[list[int]]:
    """A top-k layout for counting, the shape learned topologies take (anchors and local links): the
    anchor h_0 and the k-1 latest sources (k = 1: the latest alone); with replace, h_j is always read.
    The eager form's count depends on how many sources a block reads and whether they are contiguous."""
    rows = []
    for j in range(K):
        kept = set(range(max(0, j + 2 - k), j + 1)) | ({0} if k >= 2 else set()) if j + 1 > k else set(range(j + 1))
        rows.append(sorted(kept | ({j} if mode == "replace" else set())))
    return rows
