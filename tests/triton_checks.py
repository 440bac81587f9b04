"""Checks of the Triton aggregation kernels on CPU tensors, run by tests/test_triton_aggregation.py in
a child python with TRITON_INTERPRET=1 (set before triton is first imported, and never in the test
process itself): `python tests/triton_checks.py trunk model traffic`. Exits non-zero on the first mismatch."""
from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules, "run me with TRITON_INTERPRET=1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ancre_dit.models.topologies import ANCReTopology  # noqa: E402
from ancre_dit.models.topologies import aggregation_triton  # noqa: E402
from benchmarks.bench_aggregation import ScaleBlock  # noqa: E402

CALLS: dict[str, int] = {"sum_rows": 0, "gram": 0}


def _counted(name: str, fn):
    def wrapped(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return wrapped


aggregation_triton.sum_rows = _counted("sum_rows", aggregation_triton.sum_rows)
aggregation_triton.gram = _counted("gram", aggregation_triton.gram)


def _topology(K: int, mode: str, topk: int, history: torch.dtype, kernel: str) -> ANCReTopology:
    torch.manual_seed(0)
    topology = ANCReTopology(K, tau=1.0, mode=mode)
    with torch.no_grad():  # off the uniform start, so every weight and its gradient matter
        for logits in topology.logits:
            logits.normal_()
    if topk:
        topology.enable_topk(topk)
        topology.sparsify()
    topology.history_dtype, topology.aggregation_kernel = history, kernel
    return topology


def _rounded(h: torch.Tensor, history: torch.dtype) -> torch.Tensor:
    """h as the history keeps it: rounded to its dtype, the gradient passed through unrounded (as
    the stacked form hands it on)."""
    return h if history == torch.float32 else h + (h.to(history).float() - h).detach()


def _chain(topology: ANCReTopology, h0: torch.Tensor, blocks, history: torch.dtype) -> torch.Tensor:
    """The plain chain autograd differentiates: h_{j+1} = B(h_j) + sum_i W[j, i] h_i over the edges."""
    W = topology.mixing_weights()
    kept, h = [_rounded(h0, history)], h0
    for j, block in enumerate(blocks):
        out = block(h, None)
        for i in topology.edges[j]:
            out = out + W[j, i] * kept[i]
        h = out
        kept.append(_rounded(h, history))
    return h


def _run(topology: ANCReTopology, history: torch.dtype, chain: bool):
    K = topology.num_blocks
    torch.manual_seed(1)
    blocks = torch.nn.ModuleList(ScaleBlock() for _ in range(K))
    with torch.no_grad():
        for b in blocks:
            b.scale.uniform_(0.5, 1.5)
    h0 = torch.randn(2, 24, 40, requires_grad=True)  # 1920 elements: two kernel blocks, a partial one
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=history != torch.float32):
        out = _chain(topology, h0, blocks, history) if chain else topology(h0, blocks, None)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {"h0": h0.grad, **{f"block{k}": b.scale.grad for k, b in enumerate(blocks)},
             **{f"logits.{j}": l.grad for j, l in enumerate(topology.logits) if l.grad is not None}}
    return out.detach(), grads


def check_trunk() -> None:
    """Output and every gradient (h_0, blocks, logits) of the kernels equal the plain chain's within
    fp32 rounding: dense and sparse, add and replace, fp32 and bf16 history; the kernels ran."""
    K = 5
    gram_programs, aggregation_triton.GRAM_PROGRAMS = aggregation_triton.GRAM_PROGRAMS, 3  # 8 tiles: 3, 3, 2 each
    for mode, topk, history in (("add", 0, torch.float32), ("replace", 0, torch.bfloat16),
                                ("add", 2, torch.bfloat16), ("replace", 1, torch.float32)):
        before = dict(CALLS)
        out, grads = _run(_topology(K, mode, topk, history, "triton"), history, chain=False)
        assert CALLS["sum_rows"] - before["sum_rows"] == 2 * K + 1, CALLS  # K forward, K + h_0's backward
        assert CALLS["gram"] - before["gram"] == 1, CALLS
        ref_out, ref = _run(_topology(K, mode, topk, history, "torch"), history, chain=True)
        label = f"{mode} topk={topk} history={history}"
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5 * ref_out.abs().max().item(), msg=label)
        assert grads.keys() == ref.keys(), label
        for name in ref:
            scale = ref[name].abs().max().item()
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-5 * max(scale, 1e-12),
                                       msg=f"{label} {name}")
        if topk != 1:  # (one kept edge has weight 1 whatever its logit)
            assert any(grads[n].abs().sum() > 0 for n in grads if n.startswith("logits")), label
    aggregation_triton.GRAM_PROGRAMS = gram_programs
    print("trunk ok")


def check_model() -> None:
    """model.aggregation_kernel=triton on a tiny DiT: the same output and gradients as the torch ops,
    and the option reaches the topology through create_model."""
    from helpers import inputs, randomize, tiny_model

    results = {}
    for kernel in ("triton", "torch"):
        model = randomize(tiny_model("ancre", depth=3, aggregation_kernel=kernel))
        assert model.topology.aggregation_kernel == kernel
        x, t, y = inputs()
        calls = CALLS["sum_rows"]
        out = model(x, t, y)
        out.square().mean().backward()
        assert (CALLS["sum_rows"] > calls) == (kernel == "triton"), CALLS
        results[kernel] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (out, grads), (ref_out, ref) = results["triton"], results["torch"]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref.keys() and any(n.startswith("topology.") for n in grads)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-5 * ref[name].abs().max().item() + 1e-9,
                                   msg=name)
    print("model ok")


def check_traffic() -> None:
    """The bytes the kernel path moves equal benchmarks/traffic.py's `triton_passes`: the torch ops
    around the kernels counted by tests/test_traffic.py's dispatch-mode counter (paused while a kernel
    runs: the interpreter's own copies are not the kernel's traffic), each launch by the rows it reads
    and writes."""
    import pytest
    import test_traffic
    from benchmarks import traffic

    class Counter(test_traffic.ByteCounter):
        current = None

        def __init__(self):
            super().__init__()
            Counter.current = self

    class Counted:
        """A kernel whose launches add their own passes to the counter."""

        def __init__(self, kernel, count):
            self.kernel, self.count = kernel, count

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counter = Counter.current
                phase, counter.phase = counter.phase, None
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    counter.phase = phase
                    if phase is not None:
                        self.count(counter, *args, **kwargs)
            return launch

    def sum_rows_passes(counter, out, copy, base, base_stride, rows, index, weights, stride, terms, n, *,
                        HAS_BASE, HAS_COPY, BLOCK):
        if HAS_BASE:
            counter._add("read", base)
        counter.passes[f"{counter.phase} read"][rows.element_size()] += terms
        for t in (out, copy) if HAS_COPY else (out,):
            counter._add("write", t)

    def gram_passes(counter, partials, grads, store, *args, **kwargs):
        counter._add("read", grads)
        counter._add("read", store)

    mp = pytest.MonkeyPatch()
    mp.setattr(test_traffic, "ByteCounter", Counter)
    # a shape whose size no Gram partial (programs x 16 x 16 here) is a multiple of: those are not passes
    mp.setattr(test_traffic, "SHAPE", (2, 8, 24))
    mp.setattr(test_traffic, "N", 2 * 8 * 24)
    mp.setattr(aggregation_triton, "_sum_rows_kernel", Counted(aggregation_triton._sum_rows_kernel, sum_rows_passes))
    mp.setattr(aggregation_triton, "_gram_kernel", Counted(aggregation_triton._gram_kernel, gram_passes))
    for mode, topk, history in (("add", 0, torch.float32), ("replace", 2, torch.float32), ("add", 0, torch.bfloat16)):
        topology = test_traffic._ancre(5, mode, topk)
        topology.aggregation_kernel, topology.history_dtype = "triton", history
        counted = test_traffic._count(topology, mp, autocast=history != torch.float32)
        expected = traffic.triton_passes(topology.edges, stream=4, history=history.itemsize)
        assert counted == {k: +c for k, c in expected.items()}, (mode, topk, history, counted, expected)
    mp.undo()
    print("traffic ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        {"trunk": check_trunk, "model": check_model, "traffic": check_traffic}[name]()
