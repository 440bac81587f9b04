"""Activation checkpointing per block, the fused ANCRe aggregation, and
torch.compile of every topology family (graph breaks counted with torch._dynamo.explain)."""
from __future__ import annotations

import pytest
import torch

from helpers import inputs, randomize, tiny_model

# One per trunk family: plain loop, weighted history (ANCRe and its fixed sparse ablation),
# DenseFormer's averages, HC's and mHC's sublayer wiring.
FAMILIES = ["cascaded", "ancre", "first-previous", "denseformer", "hc", "hc-dynamic", "mhc"]


def _tiny(topology: str, seed: int = 0, depth: int = 4, **overrides):
    model = randomize(tiny_model(topology, seed=seed, depth=depth, hc_streams=3, **overrides))
    with torch.no_grad():  # move the topology off its init so every edge and stream matters
        for p in model.topology.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    return model.train()


def _grads(model, x, t, y) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same label dropout in every call
    x = x.clone().requires_grad_(True)
    model(x, t, y).square().mean().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return grads


def _saved_bytes(model, x, t, y) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters excluded), as bench_overhead counts."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, t, y).square().mean()
    return sum(seen.values())


@pytest.mark.parametrize("topology", FAMILIES)
def test_checkpointing_gives_the_same_gradients_with_less_saved_memory(topology):
    model = _tiny(topology)
    x, t, y = inputs()
    plain = _grads(model, x, t, y)
    plain_bytes = _saved_bytes(model, x, t, y)
    model.set_grad_checkpointing(True)
    checkpointed = _grads(model, x, t, y)
    assert plain.keys() == checkpointed.keys() and any("topology" in k for k in plain) == (topology not in ("cascaded", "first-previous"))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    assert _saved_bytes(model, x, t, y) < 0.6 * plain_bytes
    with torch.no_grad():  # inference: no checkpointing, same output
        model.eval()
        out = model(x, t, y)
        model.set_grad_checkpointing(False)
        assert torch.equal(out, model(x, t, y))


@pytest.mark.parametrize("topology", ["ancre", "first-previous"])
def test_fused_and_chained_aggregation_give_the_same_model_gradients(topology):
    model = _tiny(topology)
    x, t, y = inputs()
    fused = _grads(model, x, t, y)
    model.topology.use_chain = True
    chained = _grads(model, x, t, y)
    for name in fused:
        torch.testing.assert_close(fused[name], chained[name], rtol=1e-5, atol=1e-6, msg=name)
    assert (topology == "first-previous") != any(fused[n].abs().sum() > 0 for n in fused if n.startswith("topology.logits"))


def _with_gap_weights(K: int) -> torch.Tensor:
    """A fixed topology whose block 2 has no skip edge (no aggregation node makes h_2) while later
    blocks read h_0, h_2 and h_3: the sources whose gradient is collected by their earliest reader."""
    weights = torch.zeros(K, K)
    weights[0, 0] = 0.7
    weights[2, [0, 2]] = torch.tensor([0.3, 0.6])
    weights[3, [0, 2, 3]] = torch.tensor([0.2, 0.5, 0.4])
    return weights


@pytest.mark.parametrize("topology", ["learnable-scalars", "ancre-outgoing", "with-gap"])
def test_routed_history_gradients_equal_autograds_for_every_edge_layout(topology):
    """The fused backward hands each history tensor its skip-sum gradient once (absorbed by the
    node that made it, or collected by its earliest reader); every layout must equal the chain."""
    if topology == "with-gap":
        from ancre_dit.models.topologies import FixedTopology
        model = randomize(tiny_model("cascaded", depth=4))
        model.topology = FixedTopology(_with_gap_weights(4))
        assert model.topology.edges[1] == []
    else:
        model = _tiny(topology)
    x, t, y = inputs()
    fused = _grads(model, x, t, y)
    model.topology.use_chain = True
    chained = _grads(model, x, t, y)
    assert fused.keys() == chained.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], chained[name], rtol=1e-5, atol=1e-6, msg=name)


def test_routed_gradients_survive_a_retained_graph_backwarded_twice():
    model = _tiny("ancre")
    x, t, y = inputs()
    torch.manual_seed(5)
    loss = model(x, t, y).square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_trunk_history_is_contiguous_so_the_fused_backward_copies_nothing():
    """PatchEmbed's tokens are a transposed view; the history must not inherit that layout, or every
    flattening in the aggregation's backward copies an activation (measured: about a third of it)."""
    model = tiny_model("ancre")
    x, t, y = inputs()
    h0, c, _ = model.embed(x, t, y)
    assert h0.is_contiguous() and model.blocks[0](h0, c).is_contiguous()


@pytest.mark.slow
def test_compile_flag_every_family_compiles_without_graph_breaks_and_checkpointing_holds():
    """train.compile's path on the CPU: each family traces to one graph (forward and backward,
    checkpointing on), and the compiled model's gradients equal the eager ones. fullgraph=True
    makes any graph break an error; aot_eager runs the traced graphs without generating kernels,
    which keeps this test in seconds; the inductor backend is exercised by
    test_inductor_compiles_ancre_with_checkpointing."""
    x, t, y = inputs()
    for topology in FAMILIES:
        # 3 blocks: every trunk's wiring appears (block 3 reads 3 sources), traced faster; mHC's
        # Sinkhorn loop unrolls into the graph, so fewer iterations trace the same graph faster.
        model = _tiny(topology, depth=3, **({"sinkhorn_iters": 3} if topology == "mhc" else {}))
        model.set_grad_checkpointing(True)
        eager = _grads(model, x, t, y)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        got = _grads(compiled, x, t, y)
        for name in eager:
            torch.testing.assert_close(got[name], eager[name], rtol=1e-5, atol=1e-6, msg=f"{topology} {name}")


@pytest.mark.slow
def test_inductor_compiles_ancre_with_checkpointing():
    x, t, y = inputs()
    model = _tiny("ancre")
    eager = _grads(model, x, t, y)
    model.set_grad_checkpointing(True)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch._inductor.config.patch(fallback_random=True):  # the label dropout draws as in eager
        got = _grads(compiled, x, t, y)
    for name in eager:
        torch.testing.assert_close(got[name], eager[name], rtol=1e-4, atol=1e-5)
