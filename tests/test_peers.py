"""Peer residual schemes (DenseFormer, Hyper-Connections static/dynamic, mHC): equivalence with the
cascaded DiT at init, the formulas with non-trivial weights, mHC's doubly stochastic mixing,
gradients, save/load, EMA copies, bf16 autocast and torch.compile tracing."""
import copy

import pytest
import torch
from helpers import TINY_DIT, inputs, randomize, tiny_model
from safetensors.torch import load_file, save_file

from ancre_dit.models import load_state_dict_checked
from ancre_dit.models.topologies import TopologyNotDefined, sinkhorn_knopp
from ancre_dit.models.topologies import TOPOLOGIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest, and shares the box
TINY = {**TINY_DIT, "depth": 3}
PEERS = ["denseformer", "hc", "hc-dynamic", "mhc"]


def tiny(topology, seed=0, **kwargs):
    return tiny_model(topology, seed, **{**TINY, **kwargs})


def perturb_topology(model, seed=3, scale=0.3):
    """Moves every topology parameter away from its init, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.topology.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def pair(topology, **kwargs):
    """A cascaded DiT with random adaLN weights and the peer model sharing all its non-topology weights."""
    cascaded = randomize(tiny("cascaded"))
    peer = tiny(topology, seed=7, **kwargs)
    result = peer.load_state_dict(cascaded.state_dict(), strict=False)
    assert not result.unexpected_keys and all(k.startswith("topology.") for k in result.missing_keys)
    return cascaded, peer.eval()


def test_peer_names_are_registered_and_bad_settings_fail_clearly():
    assert set(PEERS) <= set(TOPOLOGIES)
    with pytest.raises(ValueError, match="hc_streams must be greater than or equal to 1"):
        tiny("hc", hc_streams=0)
    with pytest.raises(ValueError, match="mhc needs hc_streams >= 2"):
        tiny("mhc", hc_streams=1)
    with pytest.raises(ValueError, match="sinkhorn_iters must be greater than or equal to 1"):
        tiny("mhc", sinkhorn_iters=0)
    from ancre_dit.models.topologies import build_topology
    with pytest.raises(ValueError, match="needs hidden_size"):
        build_topology("hc", 3)


def test_denseformer_at_init_is_exactly_the_cascaded_dit_and_its_matrix_is_zero():
    cascaded, dense = pair("denseformer")
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(dense(x, t, y), cascaded(x, t, y))
    K = TINY["depth"]
    assert sum(p.numel() for p in dense.topology.parameters()) == K * (K + 3) // 2
    assert torch.equal(dense.topology.probabilities(), cascaded.topology.probabilities())  # zero matrix
    assert torch.equal(dense.topology.output_scales(), torch.ones(K))


def test_denseformer_with_random_weights_follows_the_dwa_formula_step_by_step():
    _, dense = pair("denseformer")
    perturb_topology(dense)
    x, t, y = inputs()
    with torch.no_grad():
        h0, c, _ = dense.embed(x, t, y)
        X, Y = [h0], h0
        for j, block in enumerate(dense.blocks):
            X.append(block(Y, c))
            Y = sum(dense.topology.alphas[j][i] * X[i] for i in range(j + 2))
        assert torch.allclose(dense.topology(h0, dense.blocks, c), Y, atol=1e-5, rtol=1e-5)
        P, scales = dense.topology.probabilities(), dense.topology.output_scales()
    K = TINY["depth"]
    for j in range(K):  # row j: block j+1's average over X_0..X_j; its own output's weight kept apart
        assert torch.equal(P[j, : j + 1], dense.topology.alphas[j][:-1].detach())
        assert P[j, j + 1:].abs().sum() == 0 and scales[j] == dense.topology.alphas[j][-1]


@pytest.mark.parametrize("topology, streams", [("hc", 4), ("hc", 2), ("hc-dynamic", 4), ("mhc", 4), ("mhc", 3)])
def test_hyper_connections_at_init_are_the_cascaded_dit(topology, streams):
    """Documented difference: the streams each hold the cascaded hidden state, so the trunk returns
    n * h_K; the final LayerNorm removes the factor up to its eps (and fp32 rounding)."""
    cascaded, peer = pair(topology, hc_streams=streams)
    x, t, y = inputs()
    with torch.no_grad():
        h0, c, _ = cascaded.embed(x, t, y)
        hK = cascaded.topology(h0, cascaded.blocks, c)
        assert torch.allclose(peer.topology(h0, peer.blocks, c), streams * hK, rtol=1e-6, atol=1e-5)
        expected = cascaded(x, t, y)
        out = peer(x, t, y)
    assert not torch.equal(out, cascaded.final_layer(h0, c))  # the blocks are not the identity
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_static_hc_with_random_matrices_follows_the_stream_formula():
    _, hc = pair("hc", hc_streams=3)
    perturb_topology(hc)
    top = hc.topology
    x, t, y = inputs()
    with torch.no_grad():
        h0, c, _ = hc.embed(x, t, y)
        streams = [h0] * 3
        for k, block in enumerate(hc.blocks):
            mod = block.modulation(c)
            for l, branch, m in ((2 * k, block.attention_branch, mod[:3]), (2 * k + 1, block.mlp_branch, mod[3:])):
                inp = sum(top.alpha_m[l, s] * streams[s] for s in range(3))
                out = branch(inp, *m)
                streams = [sum(top.alpha_r[l, s, r] * streams[s] for s in range(3)) + top.beta[l, r] * out
                           for r in range(3)]
        assert torch.allclose(top(h0, hc.blocks, c), sum(streams), atol=1e-5, rtol=1e-5)


def test_static_hc_sublayer_weights_are_the_cascaded_chain_at_init():
    _, hc = pair("hc")
    L = 2 * TINY["depth"]
    assert torch.equal(hc.topology.sublayer_weights(), torch.tril(torch.ones(L, L + 1)))


@pytest.mark.parametrize("topology", ["hc", "hc-dynamic", "mhc"])
def test_stream_schemes_have_no_block_matrix_and_say_why(topology):
    with pytest.raises(TopologyNotDefined, match="residual streams"):
        tiny(topology).topology.probabilities()
    assert issubclass(TopologyNotDefined, ValueError)


def test_mhc_mixing_is_doubly_stochastic_fp32_under_bf16_autocast():
    """20 iterations make it doubly stochastic to 1e-5 while the logits stay moderate (as here: a
    perturbed init); for logits with std >= 1 the rows drift by up to ~1e-3 (mHC-lite's point)."""
    _, mhc = pair("mhc")
    perturb_topology(mhc, scale=0.1)
    H = torch.randn(2, 5, 4, TINY["hidden_size"]).to(torch.bfloat16)
    for l in range(2 * TINY["depth"]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pre, post, res = mhc.topology.coefficients(l, H)
        assert pre.dtype == post.dtype == res.dtype == torch.float32
        assert (res >= 0).all() and res.shape == (2, 5, 4, 4)
        assert torch.allclose(res.sum(-1), torch.ones(2, 5, 4), atol=1e-5)
        assert torch.allclose(res.sum(-2), torch.ones(2, 5, 4), atol=1e-5)
        assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()
    # The projection itself, on logits far from the init.
    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(0)) * 0.5
    ds = sinkhorn_knopp(logits, 20)
    assert torch.allclose(ds.sum(-1), torch.ones(64, 4), atol=1e-5) and torch.allclose(ds.sum(-2), torch.ones(64, 4), atol=1e-5)


@pytest.mark.parametrize("topology", PEERS)
def test_gradients_reach_every_new_parameter(topology):
    """At init every topology parameter is in the graph; after one optimizer step every one gets a
    non-zero gradient (at init some get exactly zero by design: HC's tanh scales multiply W = 0,
    mHC's stream mixing acts on identical streams)."""
    _, model = pair(topology)  # eval mode: no random label dropout, gradients flow the same
    x, t, y = inputs()
    optimizer = torch.optim.AdamW(model.topology.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(2):
        optimizer.zero_grad()
        model(x, t, y).square().mean().backward()
        for name, p in model.topology.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name} at step {step}"
            if step == 1:
                assert p.grad.abs().sum() > 0, f"{name} gets no gradient"
        optimizer.step()


@pytest.mark.parametrize("topology", PEERS)
def test_save_load_and_ema_copy_give_the_same_output(topology, tmp_path):
    _, model = pair(topology)
    perturb_topology(model, scale=0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    fresh = tiny(topology, seed=11)
    load_state_dict_checked(fresh, load_file(str(tmp_path / "m.safetensors")))
    ema = copy.deepcopy(model)
    x, t, y = inputs()
    with torch.no_grad():
        expected = model(x, t, y)
        assert torch.equal(fresh.eval()(x, t, y), expected)
        assert torch.equal(ema(x, t, y), expected)
    with pytest.raises(ValueError, match="does not fit this model"):
        load_state_dict_checked(tiny("cascaded"), model.state_dict())


@pytest.mark.parametrize("topology", PEERS)
def test_bf16_autocast_runs_and_stays_close_to_fp32(topology):
    _, model = pair(topology)
    perturb_topology(model, scale=0.1)
    x, t, y = inputs()
    with torch.no_grad():
        full = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = model(x, t, y)
    assert torch.isfinite(half).all()
    assert (half.float() - full).abs().max() < 0.05 * full.abs().max()


@pytest.mark.parametrize("topology", ["hc", "hc-dynamic", "mhc"])
def test_streams_stay_fp32_under_bf16_autocast(topology):
    """Every stream after every block is fp32 (a bf16 einsum would round them at each sublayer)."""
    _, model = pair(topology)
    perturb_topology(model, scale=0.1)
    x, t, y = inputs()
    states = []
    model.topology.state_hook = lambda k, z: states.append(z)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h0, c, _ = model.embed(x, t, y)
        assert model.topology(h0.bfloat16(), model.blocks, c).dtype == torch.float32
        assert model.topology(h0, model.blocks, c).dtype == torch.float32
    assert len(states) == 2 * (model.topology.num_blocks + 1) and all(z.dtype == torch.float32 for z in states)


@pytest.mark.slow
def test_torch_compile_traces_mhc_forward_and_backward():
    """Dynamo + AOT autograd (the inductor codegen is too slow for CI on 2 cores; the overhead
    benchmark runs the full compile)."""
    _, model = pair("mhc", sinkhorn_iters=3)
    perturb_topology(model, scale=0.1)
    x, t, y = inputs()
    model(x, t, y).square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.topology.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(x, t, y).square().mean().backward()
    for name, p in model.topology.named_parameters():
        assert torch.allclose(p.grad, eager[name], rtol=1e-4, atol=1e-6), name
