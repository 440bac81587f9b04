"""The eager stacked aggregation (one history store, one product per node forward and per source
backward, a Gram product for the weights) against the plain addcmul chain autograd differentiates,
in fp64; and model.history_dtype (the kept history in bf16 under bf16 autocast)."""
from __future__ import annotations

import pytest
import torch

from ancre_dit.training.trainer import Trainer

from helpers import accelerate_state, inputs, randomize, tiny_config, tiny_model

LAYOUTS = [("ancre", {}), ("ancre", {"ancre_mode": "replace"}), ("ancre", {"topology_topk": 2}),
           ("ancre", {"topology_topk": 1, "ancre_mode": "replace"}), ("ancre-outgoing", {}), ("fixed-dense", {}),
           ("first-previous", {}), ("learnable-scalars", {}), ("ancre-unnormalized", {})]


def _model(topology: str, options: dict, depth: int = 5):
    model = randomize(tiny_model(topology, depth=depth, **options)).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # off the initial topology, so every weight and its gradient matter
        for p in model.topology.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if options.get("topology_topk"):
        model.topology.sparsify()
    return model


def _run(model, fused: bool, loss_on=None):
    """Output and every gradient (parameters and input) of a fixed weighted loss."""
    model.topology.use_chain = not fused
    model.zero_grad(set_to_none=True)
    x, t, y = inputs()
    x = x.double().requires_grad_(True)
    states = []
    model.topology.state_hook = (lambda k, z: states.append(z)) if loss_on is not None else None
    out = model(x, t, y)
    model.topology.state_hook = None
    target = states[loss_on] if loss_on is not None else out
    (target * torch.linspace(-1, 1, target.numel(), dtype=target.dtype).view_as(target)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), {**grads, "input": x.grad.clone()}


def _assert_equal_fp64(a, b):
    assert a.keys() == b.keys()
    for name in a:
        scale = b[name].abs().max().item()
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12 * max(scale, 1e-30), msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("topology, options", LAYOUTS)
def test_stacked_equals_the_chain_in_fp64(topology, options, checkpointing):
    model = _model(topology, options)
    assert model.topology._stacked_plan is not None  # every layout here has a source for every block
    model.set_grad_checkpointing(checkpointing)
    out, grads = _run(model, fused=True)
    out_chain, grads_chain = _run(model, fused=False)
    torch.testing.assert_close(out, out_chain, rtol=0, atol=1e-12 * out_chain.abs().max().item())
    _assert_equal_fp64(grads, grads_chain)
    if list(model.topology.parameters()) and options.get("topology_topk") != 1:  # (one kept edge: weight 1)
        assert any(grads[n].abs().sum() > 0 for n in grads if n.startswith("topology."))


def test_a_loss_on_an_inner_state_reaches_only_the_nodes_before_it():
    """Nodes after the state never run their backward; their gradient rows must count as zero."""
    model = _model("ancre", {})
    _, grads = _run(model, fused=True, loss_on=3)
    _, grads_chain = _run(model, fused=False, loss_on=3)
    _assert_equal_fp64(grads, grads_chain)


def test_a_retained_graph_backwarded_twice_gives_twice_the_gradients():
    model = _model("ancre", {})
    x, t, y = inputs()
    out = model(x.double(), t, y).square().sum()
    out.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out.backward()
    for n, p in model.named_parameters():
        if n in once:
            torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-12, atol=0)


def test_no_grad_forward_matches_and_the_history_store_is_one_tensor():
    model = _model("ancre", {})
    x, t, y = inputs()
    with torch.no_grad():
        stacked = model(x.double(), t, y)
        model.topology.use_chain = True
        chain = model(x.double(), t, y)
    torch.testing.assert_close(stacked, chain, rtol=0, atol=1e-12 * chain.abs().max().item())


# -- model.history_dtype -------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
def test_bf16_history_under_autocast_only(fused):
    """Under bf16 autocast the history is read in bf16 (so the output moves, slightly); without
    autocast it is the fp32 model bitwise."""
    full, half = (randomize(tiny_model("ancre", depth=4, history_dtype=d)) for d in ("float32", "bfloat16"))
    half.load_state_dict(full.state_dict())
    for m in (full, half):
        m.topology.use_chain = not fused
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(full(x, t, y), half(x, t, y))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = full(x, t, y), half(x, t, y)
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.05 * a.abs().max()
    read = []
    half.topology.state_hook = lambda k, z: read.append(z.dtype)  # the stream itself stays fp32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        half(x, t, y)
    assert read == [torch.float32] * 5


def test_bf16_history_gradients_match_between_stacked_and_chain():
    model = randomize(tiny_model("ancre", depth=4, history_dtype="bfloat16"))
    x, t, y = inputs()
    grads = {}
    for fused in (True, False):
        model.topology.use_chain = not fused
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, t, y).float().square().mean()
        loss.backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, g in grads[False].items():  # (the chain rounds the history's gradients to bf16, the stacked form not)
        torch.testing.assert_close(grads[True][name], g, rtol=0.05, atol=0.02 * g.abs().max().item(), msg=name)


@pytest.mark.slow
def test_history_dtype_enters_the_model_spec_only_when_set(tmp_path):
    """Specs of runs that do not set it stay as they were, so older runs resume."""
    for overrides, expected in (((), None), (("model.history_dtype=bfloat16",), "bfloat16")):
        with accelerate_state():
            trainer = Trainer(tiny_config(tmp_path / str(expected), *overrides))
            try:
                kwargs = trainer.checkpoints.spec["model"]["kwargs"]
                assert kwargs.get("history_dtype") == expected and "topology_topk" not in kwargs
                assert trainer.raw_model.topology.history_dtype == (torch.bfloat16 if expected else torch.float32)
            finally:
                trainer.accelerator.end_training()
