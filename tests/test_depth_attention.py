"""DAR and AttnRes in the DiT backbone: the plain DiT at init, S = 1 equal to the dense form (checked
against a reference written out here), the parameter counts of the papers' formulas, gradients to
every routing parameter, compile, activation checkpointing, bf16, and one-line errors."""
from __future__ import annotations

import math

import pytest
import torch

from ancre_dit import create_model
from ancre_dit.errors import UserError

KW = dict(input_size=8, in_channels=1, num_classes=10, learn_sigma=False, hidden_size=32, num_heads=2)
VARIANTS = [("dar", {"query": q, "chunk": s}) for q in ("static", "static-t", "dynamic") for s in (1, 4)] + \
           [("attnres", {"block": 0}), ("attnres", {"block": 2}), ("attnres", {"block": 4, "query": "dynamic"})]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in opts.items())}" for name, opts in VARIANTS]


def batch(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 10, (n,), generator=g))


def model_of(name: str, depth: int = 4, seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_model("DiT-S/2", depth=depth, topology=name, **KW, **options).eval()


def randomize(model: torch.nn.Module, *, blocks: bool, routing: bool, seed: int = 0) -> torch.nn.Module:
    """Random weights: always the final layer (zero at init), the blocks (gates included) if `blocks`,
    the routing parameters if `routing`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            chosen = (name.startswith("final_layer") or (blocks and name.startswith("blocks"))
                      or (routing and name.startswith("topology")))
            if chosen:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("topology") else 0.05) + (
                    1.0 if name.endswith("key_norms") else 0.0))
    return model


def final_state(model) -> torch.Tensor:
    states = {}
    model.topology.state_hook = lambda k, z: states.__setitem__(k, z.detach())
    out = model(*batch())
    model.topology.state_hook = None
    return states[max(states)], out


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_equals_the_plain_dit_at_init(name, options):
    """Uniform weights and zero sublayer outputs: the state fed to the final layer is v_0 / |S|
    (|S| the final aggregator's sources) where the plain DiT has v_0, and the final LayerNorm
    ignores that scale (up to its eps of 1e-6 against the state's variance)."""
    plain = randomize(model_of("cascaded"), blocks=False, routing=False)
    routed = randomize(model_of(name, **options), blocks=False, routing=False)
    (z_plain, out_plain), (z_routed, out_routed) = final_state(plain), final_state(routed)
    sources = len(routed.topology._source_ids[-1])
    torch.testing.assert_close(z_routed * sources, z_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_routed, out_plain, rtol=2e-3, atol=2e-4)


def dense_reference(model, x, t, y, scale: float) -> torch.Tensor:
    """Dense depth attention written out: every sublayer (and the final aggregator) attends over all
    earlier outputs v_0..v_{l-1} with alpha = softmax(q . RMSNorm(v) * scale), values raw."""
    topo = model.topology
    h0, c, _ = model.embed(x, t, y)
    t_emb = model.t_embedder(t)
    outputs, previous = [h0], h0

    def aggregate(l):
        g = topo.key_norms[l]
        keys = [v / v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * g for v in outputs]
        if topo.query == "dynamic":
            q = previous @ topo.query_maps[l].T
            logits = torch.stack([(k * q).sum(-1) for k in keys], -1)
        else:
            q = topo.queries[l] + (topo.time_head(t_emb) if topo.query == "static-t" else 0)
            q = q if q.dim() == 2 else q.expand(x.shape[0], -1)
            logits = torch.stack([(k * q[:, None, :]).sum(-1) for k in keys], -1)
        alpha = torch.softmax(logits * scale, -1)
        return sum(alpha[..., i:i + 1] * v for i, v in enumerate(outputs))

    layer = 0
    for block in model.blocks:
        mod = block.modulation(c)
        for branch, m in ((block.attention_branch, mod[:3]), (block.mlp_branch, mod[3:])):
            v = branch(aggregate(layer), *m)
            outputs.append(v)
            previous = v
            layer += 1
    return model.unpatchify(model.final_layer(aggregate(layer), c))


@pytest.mark.parametrize("name,options", [("dar", {"query": q, "chunk": 1}) for q in ("static", "static-t", "dynamic")]
                         + [("attnres", {"block": 0}), ("attnres", {"block": 1}),
                            ("attnres", {"block": 1, "query": "dynamic"})])
def test_s1_and_full_are_the_dense_form(name, options):
    model = randomize(model_of(name, **options), blocks=True, routing=True)
    scale = 1 / math.sqrt(32) if name == "dar" else 1.0
    x, t, y = batch()
    torch.testing.assert_close(model(x, t, y), dense_reference(model, x, t, y, scale), rtol=1e-5, atol=1e-5)


def test_chunks_and_blocks_read_summaries():
    """With S = L the whole trunk is one chunk (DAR: every sublayer sees v_0 and its chunk's outputs,
    the dense form again) while Block AttnRes over one block sees v_0 and one running sum."""
    dar_one_chunk = randomize(model_of("dar", chunk=8), blocks=True, routing=True)
    dense = model_of("dar", chunk=1)
    dense.load_state_dict(dar_one_chunk.state_dict())
    torch.testing.assert_close(dar_one_chunk(*batch()), dense(*batch()), rtol=1e-5, atol=1e-5)
    blocks = randomize(model_of("attnres", block=2), blocks=True, routing=True)
    full = model_of("attnres", block=0)
    full.load_state_dict(blocks.state_dict())
    assert (blocks(*batch()) - full(*batch())).abs().max() > 1e-4  # sums, not single outputs
    blocks.topology.record_weights = True
    blocks(*batch())
    W = blocks.topology.routing_weights()  # rows: 8 sublayers + the final aggregator
    assert W.shape == (9, 9)
    torch.testing.assert_close(W.sum(1), torch.ones(9))
    assert W[0].nonzero().flatten().tolist() == [0]          # sublayer 1: only the embedding
    assert W[1].nonzero().flatten().tolist() == [0, 1]       # sublayer 2: v_0 and the partial sum (v_1)
    assert W[2].nonzero().flatten().tolist() == [0, 2]       # sublayer 3: v_0 and block 1's sum (filed at 2)
    assert W[8].nonzero().flatten().tolist() == [0, 2, 4, 6, 8]  # final: every block sum


@pytest.mark.parametrize("name,options,per_aggregator,shared", [
    ("dar", {"query": "static"}, lambda d: 2 * d, lambda d: 0),
    ("dar", {"query": "static-t"}, lambda d: 2 * d, lambda d: d * d + d),  # the shared time head
    ("dar", {"query": "dynamic"}, lambda d: d * d + d, lambda d: 0),
    ("attnres", {"block": 0}, lambda d: 2 * d, lambda d: 0),
])
def test_parameter_counts_follow_the_formulas(name, options, per_aggregator, shared):
    d, K = 32, 4
    topology = model_of(name, depth=K, **options).topology
    assert sum(p.numel() for p in topology.parameters()) == (2 * K + 1) * per_aggregator(d) + shared(d)


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_gradients_reach_every_routing_parameter(name, options):
    model = randomize(model_of(name, **options), blocks=True, routing=True).train()
    model(*batch()).square().mean().backward()
    for p in model.topology.routing_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("name,options", [("dar", {"query": "static-t"}), ("dar", {"query": "dynamic"}),
                                          ("attnres", {"block": 2})])
def test_activation_checkpointing_gives_the_same_gradients_and_bf16_runs(name, options):
    grads = []
    for checkpointed in (False, True):
        model = randomize(model_of(name, **options), blocks=True, routing=True).train()
        model.set_grad_checkpointing(checkpointed)
        model(*batch()).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)
    model = randomize(model_of(name, **options), blocks=True, routing=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(*batch())
    assert torch.isfinite(low).all()
    torch.testing.assert_close(low.float(), model(*batch()), rtol=0.1, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("dar", {"query": "static-t", "chunk": 4}), ("dar", {"query": "dynamic"}),
                                          ("attnres", {"block": 2})])
def test_compiles_to_one_graph_without_breaks(name, options):
    model = randomize(model_of(name, **options), blocks=True, routing=True)
    explanation = torch._dynamo.explain(model)(*batch())
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


def test_bad_options_are_one_line():
    with pytest.raises(UserError, match="chunk 3 does not divide the 8 sublayers"):
        model_of("dar", chunk=3)
    with pytest.raises(UserError, match="block 3 does not divide the 8 sublayers"):
        model_of("attnres", block=3)
    with pytest.raises(UserError, match="query must be 'static', 'static-t' or 'dynamic'"):
        model_of("dar", query="learned")
    with pytest.raises(UserError, match="chunk must be greater than or equal to 1"):
        model_of("dar", chunk=0)


@pytest.mark.slow
@pytest.mark.parametrize("options", [["model.query=static", "model.chunk=2"], ["model.query=static-t", "model.chunk=4"],
                                     ["model.query=dynamic", "model.chunk=1"], ["model.block=0"],
                                     ["model.block=2", "model.query=dynamic"]],
                         ids=["dar-static", "dar-static-t", "dar-dynamic", "attnres-full", "attnres-block"])
def test_trains_resumes_samples_and_evaluates(tmp_path, options):
    """Through the normal paths: a run resumed from its step-2 checkpoint ends bitwise where the
    straight run ends, the checkpoint samples, and evaluate.py --run scores every checkpoint."""
    import numpy as np

    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.sampling.api import sample_images
    from ancre_dit.training.run_evaluation import evaluate_run

    from helpers import train_straight_and_resumed

    topology = "model.topology=dar" if any("chunk" in o for o in options) else "model.topology=attnres"
    folder = train_straight_and_resumed(tmp_path, topology, *options, "train.ckpt_every=2", "train.eval_every=2",
                                        "eval.heldout_max=8", "eval.num_samples=10", "eval.batch_size=10",
                                        "eval.sampler=ddim", "eval.steps=2")
    model, spec = load_trained_model(folder)
    assert spec["model"]["kwargs"]["topology"] == topology.split("=")[1]
    images = sample_images(model, spec["diffusion"], [1, 2], sampler="ddim", steps=3, seed=0)
    assert images.shape == (2, 8, 8, 1) and images.dtype == np.uint8
    entries = evaluate_run(tmp_path / "resumed", overrides=["eval.heldout_draws=1"], log=lambda *a: None)
    assert [e["step"] for e in entries] == [2, 4] and all(np.isfinite(e["metrics"]["heldout_loss"]) for e in entries)


def test_show_draws_the_routing_weights_at_each_t_and_matrix_tools_refuse(tmp_path, capsys):
    import json

    from ancre_dit.checkpoint import make_model_spec, write_model_files
    from helpers import ROOT, load_script

    kwargs = dict(KW, depth=4, topology="dar", query="static-t", chunk=2)
    model = randomize(model_of("dar", query="static-t", chunk=2), blocks=True, routing=True)
    data = {"kind": "digits", "image_size": 8, "image_channels": 1, "num_classes": 10, "vae": None, "scaling_factor": None}
    folder = tmp_path / "ckpt"
    write_model_files(folder, make_model_spec("DiT-S/2", kwargs, {"objective": "flow", "learn_sigma": False}, data, 3),
                      model.state_dict(), model.state_dict())
    main = load_script(ROOT / "scripts" / "topology.py").main
    assert main(["show", str(folder), "--t", "0.1", "0.9", "--out", str(tmp_path / "r.png"),
                 "--summary-json", str(tmp_path / "r.json")]) == 0
    weights = {t: torch.tensor(w) for t, w in json.loads((tmp_path / "r.json").read_text()).items()}
    assert set(weights) == {"t=0.1", "t=0.9"} and (tmp_path / "r.png").is_file()
    for W in weights.values():
        assert W.shape == (9, 9)
        torch.testing.assert_close(W.sum(1), torch.ones(9))
        assert torch.equal(W, torch.tril(W))  # sources come before their reader
    assert (weights["t=0.1"] - weights["t=0.9"]).abs().max() > 1e-4  # the weights depend on t
    # a folder: one heatmap per t beside the panel figure, and the same numbers
    assert main(["show", str(folder), "--t", "0.1", "0.9", "--out", str(tmp_path / "drawn")]) == 0
    assert sorted(p.name for p in (tmp_path / "drawn").iterdir()) == [
        "routing.png", "routing_t0.1.png", "routing_t0.9.png", "routing_weights.json"]
    assert json.loads((tmp_path / "drawn" / "routing_weights.json").read_text()) == json.loads(
        (tmp_path / "r.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no routing drawing"):
        main(["show", str(folder), "--out", str(tmp_path / "other")])
    with pytest.raises(UserError, match="HC, mHC, DAR and AttnRes have none"):
        main(["compare", str(folder), str(folder), "--out", str(tmp_path / "c.png")])
