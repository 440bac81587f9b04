"""DiT backbones and the ANCRe topology: shapes, parameter counts, the reference formula,
ablation variants, gradients, checkpoint import and torch.compile."""
import json

import pytest
import torch
from helpers import TINY_DIT, inputs, randomize, tiny_model

from ancre_dit import DIT_MODELS, convert_official_state_dict, create_model
from ancre_dit.models import load_state_dict_checked, load_topology_json, save_topology_json
from ancre_dit.models.topologies import TOPOLOGIES, first_previous_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest, and shares the box
TINY = {**TINY_DIT, "depth": 4}  # 4 blocks: a topology matrix with room for non-trivial rows


def tiny(topology="ancre", seed=0, **kwargs):
    return tiny_model(topology, seed, **{**TINY, **kwargs})


def set_logits(model, seed=3, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.topology.logits:
            p.copy_(torch.randn(p.shape, generator=g) * scale)


# L and XL take seconds even on the meta device (24-28 blocks): kept for the full run
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name.startswith(("DiT-L", "DiT-XL"))
                                  else name for name in DIT_MODELS])
def test_every_registered_model_maps_latents_to_eps_and_sigma(name):
    with torch.device("meta"):  # shapes only: no memory or time spent on XL weights
        model = create_model(name, topology="ancre")
        out = model(torch.empty(2, 4, 32, 32), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    assert out.shape == (2, 8, 32, 32)
    assert model.out_channels == 8 and len(model.blocks) == model.topology.num_blocks


def test_digits_shape_and_fixed_variance_output():
    model = tiny(learn_sigma=False)
    x, t, y = inputs()
    assert model(x, t, y).shape == (3, 1, 8, 8)


def count(model, trainable=False):
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def test_parameter_counts_match_the_dit_paper():
    with torch.device("meta"):
        s, b = create_model("DiT-S/2"), create_model("DiT-B/2")
        s_ancre, b_ancre = create_model("DiT-S/2", topology="ancre"), create_model("DiT-B/2", topology="ancre")
    # Derived by hand from the layer shapes (pos_embed included, as DiT's 675,129,632 for XL/2):
    assert count(s) == 32_963_360 and round(count(s) / 1e6) == 33
    assert count(b) == 130_512_416 and round(count(b) / 1e6) == 131  # the paper rounds down to 130M
    with torch.device("meta"):
        assert count(create_model("DiT-XL/2")) == 675_129_632
    for plain, ancre in ((s, s_ancre), (b, b_ancre)):
        assert count(ancre) - count(plain) == 78  # K(K+1)/2 stored logits
        assert count(ancre, trainable=True) - count(plain, trainable=True) == 77  # block 1's is frozen


def test_ancre_output_equals_the_reference_formula_step_by_step():
    model = randomize(tiny())
    set_logits(model)
    x, t, y = inputs()
    tau = model.topology.tau
    with torch.no_grad():
        h0, c, _ = model.embed(x, t, y)
        history = [h0]
        for j, block in enumerate(model.blocks):
            p = torch.softmax(model.topology.logits[j] / tau, dim=0)
            agg = sum(p[i] * history[i] for i in range(j + 1))
            history.append(block(history[-1], c) + agg)
        expected = model.unpatchify(model.final_layer(history[-1], c))
        assert torch.allclose(model(x, t, y), expected, atol=1e-5, rtol=1e-5)


def test_ancre_at_init_adds_the_mean_of_the_history():
    """adaLN-Zero blocks are the identity at init, so h_j = h_{j-1} + mean_{i<j} h_i (PAPER.md)."""
    model = tiny().eval()
    x, t, y = inputs()
    with torch.no_grad():
        h0, c, _ = model.embed(x, t, y)
        history = [h0]
        for _ in model.blocks:
            history.append(history[-1] + torch.stack(history).mean(0))
        assert torch.allclose(model.topology(h0, model.blocks, c), history[-1], rtol=1e-5, atol=1e-5)


def test_cascaded_topology_json_frozen_back_reproduces_plain_dit(tmp_path):
    cascaded = randomize(tiny("cascaded"))
    save_topology_json(tmp_path / "p.json", cascaded.topology.probabilities())
    frozen = tiny("frozen", topology_path=str(tmp_path / "p.json"))
    frozen.load_state_dict(cascaded.state_dict(), strict=False)
    frozen.eval()
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(frozen(x, t, y), cascaded(x, t, y))


def test_one_hot_previous_topology_is_the_cascaded_formula_with_its_extra_skip():
    """A one-hot ANCRe topology on the previous node gives h_j = B_j(h_{j-1}) + h_{j-1}: the
    learnable-scalars ablation at init, computed here by hand too."""
    ancre = randomize(tiny("ancre"))
    with torch.no_grad():
        for j, p in enumerate(ancre.topology.logits):
            p.zero_()
            p[j] = 1.0  # exp(1 / 0.01) dominance: the other weights underflow to 0 in float32
    scalars = tiny("learnable-scalars")
    scalars.load_state_dict(ancre.state_dict(), strict=False)
    scalars.eval()
    x, t, y = inputs()
    with torch.no_grad():
        h0, c, _ = ancre.embed(x, t, y)
        h = h0
        for block in ancre.blocks:
            h = block(h, c) + h
        expected = ancre.unpatchify(ancre.final_layer(h, c))
        assert torch.equal(ancre(x, t, y), expected)
        assert torch.equal(scalars(x, t, y), expected)


def test_ingoing_rows_and_outgoing_columns_sum_to_one():
    ingoing, outgoing = tiny("ancre"), tiny("ancre-outgoing")
    set_logits(ingoing, scale=0.05)
    set_logits(outgoing, scale=0.05)
    P, Q = ingoing.topology.probabilities(), outgoing.topology.probabilities()
    K = P.shape[0]
    assert torch.allclose(P.sum(1), torch.ones(K)) and torch.allclose(Q.sum(0), torch.ones(K))
    assert torch.equal(torch.triu(P, 1), torch.zeros(K, K)) and torch.equal(torch.triu(Q, 1), torch.zeros(K, K))
    assert not torch.allclose(P.sum(0), torch.ones(K))  # the two normalizations really differ


def test_ablation_variants_have_the_documented_initial_weights(tmp_path):
    K = TINY["depth"]
    uniform = torch.tril(torch.ones(K, K)) / torch.arange(1, K + 1)[:, None]
    assert torch.allclose(tiny("ancre").topology.probabilities(), uniform)
    assert torch.allclose(tiny("ancre-unnormalized").topology.probabilities(), uniform)
    assert torch.allclose(tiny("fixed-dense").topology.probabilities(), uniform)
    assert torch.equal(tiny("learnable-scalars").topology.probabilities(), torch.eye(K))
    first_previous = tiny("first-previous").topology.probabilities()
    assert torch.equal(first_previous, first_previous_weights(K))
    assert first_previous[2].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert tiny("cascaded").topology.probabilities().abs().sum() == 0
    for frozen_kind in ("fixed-dense", "first-previous"):
        assert not any(p.requires_grad for p in tiny(frozen_kind).topology.parameters())
    save_topology_json(tmp_path / "t.json", uniform)
    assert torch.equal(tiny("frozen", topology_path=str(tmp_path / "t.json")).topology.probabilities(), uniform)
    assert torch.equal(load_topology_json(tmp_path / "t.json"), uniform)


def test_unknown_topology_and_bad_sizes_fail_with_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="unknown topology 'ancr'; choose one of cascaded, ancre"):
        tiny("ancr")
    with pytest.raises(ValueError, match="unknown model 'DiT-Q/2'"):
        create_model("DiT-Q/2")
    with pytest.raises(ValueError, match="input size 30 is not divisible by patch size 4"):
        create_model("DiT-T/4", input_size=30)
    with pytest.raises(ValueError, match="needs topology_path"):
        tiny("frozen")
    save_topology_json(tmp_path / "t.json", torch.eye(3))
    with pytest.raises(ValueError, match="3-block topology, the model has 4 blocks"):
        tiny("frozen", topology_path=str(tmp_path / "t.json"))
    with pytest.raises(FileNotFoundError, match="not found"):
        tiny("frozen", topology_path=str(tmp_path / "missing.json"))
    assert set(TOPOLOGIES) >= {"cascaded", "ancre", "ancre-outgoing", "ancre-unnormalized", "fixed-dense",
                               "learnable-scalars", "first-previous", "frozen"}


def test_gradients_reach_every_trainable_logit_and_no_frozen_one():
    model = randomize(tiny())
    set_logits(model, scale=0.01)
    model.train()
    x, t, y = inputs()
    model(x, t, y).square().mean().backward()
    logits = model.topology.logits
    assert logits[0].grad is None and not logits[0].requires_grad
    for j in range(1, len(logits)):
        assert logits[j].grad is not None and (logits[j].grad.abs() > 0).all(), f"block {j + 1}"


def test_class_dropout_uses_the_null_class_and_cfg_forward_guides_the_first_half():
    model = randomize(tiny(class_dropout_prob=0.1))
    x, t, y = inputs(2)
    assert model.y_embedder.embedding_table.num_embeddings == 11
    null = torch.full_like(y, 10)
    xx, tt, yy = torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null])
    with torch.no_grad():
        out = model.forward_with_cfg(xx, tt, yy, cfg_scale=4.0)
        cond, uncond = model(x, t, y), model(x, t, null)
    guided = uncond[:, :1] + 4.0 * (cond[:, :1] - uncond[:, :1])
    assert torch.allclose(out[:2, :1], guided, atol=1e-5) and torch.allclose(out[2:, :1], guided, atol=1e-5)
    assert torch.allclose(out[:2, 1:], cond[:, 1:], atol=1e-6)  # variance channels are not guided


def test_sin_cos_position_embedding_is_present_and_frozen():
    model = tiny()
    assert not model.pos_embed.requires_grad
    pe = model.pos_embed[0]
    assert pe.abs().sum() > 0 and len({tuple(r.tolist()) for r in pe}) == pe.shape[0]  # one code per token


def official_layout(state):
    """An ANCRe checkpoint as the official code writes it: DDP + compile prefixes, its own topology names."""
    out = {}
    for key, value in state.items():
        key = key.replace("topology.logits.", "ancre.shortcut_params.").replace("topology.tau", "ancre.softmax_temp")
        out["module._orig_mod." + key] = value.clone()
    return {"model": {k: torch.zeros_like(v) for k, v in out.items()}, "ema": out, "args": "namespace"}


def test_official_ancre_checkpoint_converts_loads_and_gives_the_same_output():
    source = randomize(tiny())
    set_logits(source)
    checkpoint = official_layout(source.state_dict())
    assert any(k.startswith("module._orig_mod.ancre.shortcut_params.") for k in checkpoint["ema"])
    target = tiny(seed=5)
    load_state_dict_checked(target, convert_official_state_dict(checkpoint))
    target.eval()
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(target(x, t, y), source(x, t, y))


def test_original_dit_checkpoint_loads_into_the_cascaded_model():
    source = randomize(tiny("cascaded"))
    dit_release = {"module." + k: v for k, v in source.state_dict().items()}
    target = tiny("cascaded", seed=9)
    load_state_dict_checked(target, convert_official_state_dict(dit_release))
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(target.eval()(x, t, y), source(x, t, y))


@pytest.mark.parametrize("other, expected", [
    (dict(topology="cascaded"), "topology"),
    (dict(depth=6), "depth 6 vs 4"),
    (dict(hidden_size=64), "hidden size 64 vs 32"),
    (dict(learn_sigma=False), "output channels 1 vs 2"),
])
def test_checkpoint_of_another_architecture_fails_with_one_line(other, expected):
    checkpoint = tiny(**other).state_dict()
    with pytest.raises(ValueError) as err:
        load_state_dict_checked(tiny(), checkpoint, source="ckpt.pt")
    message = str(err.value)
    assert "\n" not in message and expected in message and message.startswith("ckpt.pt does not fit this model")


@pytest.mark.slow
def test_torch_compile_matches_eager():
    model = randomize(tiny())
    set_logits(model)
    x, t, y = inputs()
    compiled = torch.compile(model)
    with torch.no_grad():
        assert torch.allclose(compiled(x, t, y), model(x, t, y), atol=1e-5, rtol=1e-4)


def test_topology_json_is_readable_by_people(tmp_path):
    save_topology_json(tmp_path / "t.json", torch.eye(2), step=10)
    payload = json.loads((tmp_path / "t.json").read_text())
    assert payload["num_blocks"] == 2 and payload["step"] == 10 and payload["probabilities"] == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.slow
def test_model_patch_size_overrides_the_named_models_and_reaches_the_checkpoint(tmp_path):
    """LightningDiT-XL/1's patch size 1 on a /2 size: the run trains, its spec rebuilds the patch-1
    network, and a patch size that does not divide the input is one line before training."""
    from helpers import accelerate_state, tiny_config

    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.errors import UserError
    from ancre_dit.training import train

    with accelerate_state():
        train(tiny_config(tmp_path / "p1", "model.patch_size=1", "train.max_steps=2"))
    model, spec = load_trained_model(tmp_path / "p1/checkpoints/0000002")
    assert spec["model"]["kwargs"]["patch_size"] == 1 and model.patch_size == 1
    assert model.x_embedder.num_patches == 64  # 8 x 8 digits, one token per pixel
    with accelerate_state(), pytest.raises(UserError, match="data.image_size 8 is not divisible by the patch size 3 "
                                                           "of model.patch_size"):
        train(tiny_config(tmp_path / "p3", "model.patch_size=3", "train.max_steps=2"))
    assert not (tmp_path / "p3").exists()
