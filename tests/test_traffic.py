"""benchmarks/traffic.py's count of the bytes ANCRe's aggregation moves equals an independent count:
a dispatch mode that adds up the activation-sized tensors each aten op inside the aggregation reads
and writes (views and allocations move nothing)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ancre_dit.models.topologies import ANCReTopology
from ancre_dit.models.topologies import aggregation
from benchmarks import traffic
from benchmarks.bench_aggregation import ScaleBlock

SHAPE = (2, 8, 16)
N = 2 * 8 * 16
WRITE_ONLY = {"copy_", "zero_", "fill_"}  # in-place ops that do not read their destination
MOVES_NOTHING = {"empty", "empty_like", "empty_strided", "set_"}


class ByteCounter(TorchDispatchMode):
    """Activation-sized passes (numel a multiple of N) per (phase, read/write, bytes per element),
    counted while `phase` is set."""

    def __init__(self):
        super().__init__()
        self.phase: str | None = None
        self.passes = {f"{p} {k}": Counter() for p in ("forward", "backward") for k in ("read", "write")}

    def _add(self, kind: str, t: torch.Tensor) -> None:
        if t.numel() and t.numel() % N == 0 and t.device.type != "meta":
            self.passes[f"{self.phase} {kind}"][t.element_size()] += t.numel() // N

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.phase is None or func.is_view or name in MOVES_NOTHING:
            return out
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        mutated = False
        for arg, value in zip(schema.arguments, values):
            if not isinstance(value, torch.Tensor):
                continue
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written:
                mutated = True
                self._add("write", value)
            if not written or (not arg.is_out and name not in WRITE_ONLY):
                self._add("read", value)
        if not mutated:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self._add("write", t)
        return out


def _count(topology, monkeypatch, autocast: bool = False) -> dict[str, Counter]:
    counter = ByteCounter()
    forward, backward, init = (aggregation._StackedNode.forward, aggregation._StackedNode.backward,
                               aggregation.StackedTrunk.__init__)

    def phase(name, fn):
        def wrapped(*a, **k):
            counter.phase = name
            try:
                return fn(*a, **k)
            finally:
                counter.phase = None
        return wrapped

    monkeypatch.setattr(aggregation._StackedNode, "forward", staticmethod(phase("forward", forward)))
    monkeypatch.setattr(aggregation._StackedNode, "backward", staticmethod(phase("backward", backward)))
    monkeypatch.setattr(aggregation.StackedTrunk, "__init__", phase("forward", init))
    blocks = torch.nn.ModuleList(ScaleBlock() for _ in range(topology.num_blocks))
    h0 = torch.randn(SHAPE, requires_grad=True)
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = topology(h0, blocks, None)
    with counter:
        out.sum().backward()
    assert all(l.grad is not None for l in topology.logits[1:]) and h0.grad is not None
    return {k: Counter({b: n for b, n in c.items() if n}) for k, c in counter.passes.items()}


def _ancre(K: int, mode: str = "add", topk: int = 0) -> ANCReTopology:
    topology = ANCReTopology(K, tau=1.0, mode=mode)
    with torch.no_grad():
        for logits in topology.logits:
            logits.normal_()
    if topk:
        topology.enable_topk(topk)
        topology.sparsify()
    return topology


@pytest.mark.parametrize("mode", ["add", "replace"])
@pytest.mark.parametrize("topk", [0, 1, 2])
def test_counted_bytes_equal_the_model(mode, topk, monkeypatch):
    topology = _ancre(6, mode, topk)
    expected = traffic.stacked_passes(topology.edges, stream=4, history=4)
    assert _count(topology, monkeypatch) == {k: Counter({b: n for b, n in c.items() if n}) for k, c in expected.items()}


def test_counted_bytes_equal_the_model_with_a_bf16_history(monkeypatch):
    topology = _ancre(5)
    topology.history_dtype = torch.bfloat16
    expected = traffic.stacked_passes(topology.edges, stream=4, history=2)
    assert _count(topology, monkeypatch, autocast=True) == {
        k: Counter({b: n for b, n in c.items() if n}) for k, c in expected.items()}


def test_dense_stacked_form_is_within_a_pass_or_two_of_the_floor():
    """fp32 dense: the only pass above the floor is h_0's copy into the store (and the last node's
    copy of its incoming gradient); the per-edge chain reads each source twice more."""
    edges = traffic.dense_edges(12)
    stacked, floor = (sum(sum(c.values()) for c in f(edges).values()) for f in (traffic.stacked_passes,
                                                                                  traffic.floor_passes))
    assert stacked - floor == 2 and floor == 2 * 78 + 6 * 12 + 1  # each edge twice, a few passes per block
