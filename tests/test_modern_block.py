"""The LightningDiT block as switches (model.norm, model.mlp, model.pos_embed, model.qk_norm): the
defaults are today's DiT, RoPE scores depend only on relative positions, the SwiGLU width rule keeps
the parameter count, every topology takes every option, and checkpoints record the choices."""
from __future__ import annotations

import pytest
import torch
from timm.layers import apply_rot_embed_cat

from ancre_dit import create_model
from ancre_dit.errors import UserError
from ancre_dit.models.layers import axial_rope, make_mlp, make_norm, swiglu_hidden
from ancre_dit.models.topologies import TOPOLOGIES

KW = dict(input_size=8, in_channels=1, num_classes=10, learn_sigma=False, depth=2, hidden_size=32, num_heads=2)
MODERN = dict(norm="rmsnorm", mlp="swiglu", pos_embed="rope2d", qk_norm=True)
OPTIONS = [dict(norm="rmsnorm"), dict(mlp="swiglu"), dict(pos_embed="rope2d"), dict(qk_norm=True), MODERN]
OPTION_IDS = ["rmsnorm", "swiglu", "rope2d", "qk_norm", "all"]


def batch(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 10, (n,), generator=g))


def randomized(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_defaults_are_the_dit_block():
    torch.manual_seed(0)
    plain = create_model("DiT-S/2", **KW)
    torch.manual_seed(0)
    explicit = create_model("DiT-S/2", norm="layernorm", mlp="gelu", pos_embed="sincos", qk_norm=False, **KW)
    assert list(plain.state_dict()) == list(explicit.state_dict())
    assert all(torch.equal(v, explicit.state_dict()[k]) for k, v in plain.state_dict().items())
    assert plain.blocks[0].rope is None and plain.pos_embed.abs().sum() > 0


def test_rope_scores_depend_only_on_relative_position():
    """The same query and key vectors, rotated at every position of an 8 x 8 grid: q_i . k_j is the
    same for every pair (i, j) with the same 2D offset, i.e. unchanged when both are shifted."""
    grid, head_dim = 8, 16
    rope = axial_rope(head_dim, grid)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    q_rot = apply_rot_embed_cat(q.expand(grid * grid, head_dim), rope)
    k_rot = apply_rot_embed_cat(k.expand(grid * grid, head_dim), rope)
    scores = (q_rot @ k_rot.T).reshape(grid, grid, grid, grid)  # [qy, qx, ky, kx]
    for dy, dx in ((0, 1), (1, 0), (2, -3), (-1, -1)):
        values = [scores[y, x, y + dy, x + dx] for y in range(grid) for x in range(grid)
                  if 0 <= y + dy < grid and 0 <= x + dx < grid]
        torch.testing.assert_close(torch.stack(values), values[0].expand(len(values)), rtol=1e-4, atol=1e-4)
    assert (scores[0, 0, 0, 1] - scores[0, 0, 0, 2]).abs() > 1e-3  # and it does depend on the offset


def test_rope_replaces_the_absolute_embedding():
    model = create_model("DiT-S/2", pos_embed="rope2d", **KW)
    assert model.pos_embed.abs().sum() == 0 and model.blocks[0].rope.shape == (16, 2 * 16)
    assert "blocks.0.rope" not in model.state_dict()  # rebuilt from the options, never stored


def test_lightningdits_position_code_is_both_the_sincos_table_and_rope():
    both, sincos = create_model("DiT-S/2", pos_embed="sincos+rope2d", **KW), create_model("DiT-S/2", **KW)
    assert torch.equal(both.pos_embed, sincos.pos_embed) and both.pos_embed.abs().sum() > 0
    rope_only = create_model("DiT-S/2", pos_embed="rope2d", **KW)
    assert both.blocks[0].rope.shape == (16, 2 * 16) and torch.equal(both.blocks[0].rope, rope_only.blocks[0].rope)


@pytest.mark.parametrize("dim", [384, 768, 1152])
def test_swiglu_keeps_the_gelu_parameter_count(dim):
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    gelu, swiglu = make_mlp("gelu", dim, 4.0), make_mlp("swiglu", dim, 4.0)
    assert swiglu_hidden(dim, 4.0) == int(8 * dim / 3)
    assert abs(count(swiglu) - count(gelu)) / count(gelu) < 0.001


def test_rmsnorm_is_torch_rmsnorm_without_affine():
    x = torch.randn(2, 5, 32)
    norm = make_norm("rmsnorm", 32)
    assert isinstance(norm, torch.nn.RMSNorm) and not list(norm.parameters())
    torch.testing.assert_close(norm(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_every_topology_takes_every_option(name, tmp_path):
    from ancre_dit.models.topologies import save_topology_json

    save_topology_json(tmp_path / "p.json", torch.tril(torch.ones(2, 2)) / 2)
    extra = {"topology_path": str(tmp_path / "p.json")} if name == "frozen" else {"chunk": 2} if name == "dar" else {}
    model = randomized(create_model("DiT-S/2", topology=name, **KW, **MODERN, **extra)).train()
    out = model(*batch())
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_grad_checkpointing_gives_the_same_gradients(options):
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = randomized(create_model("DiT-S/2", topology="ancre", **KW, **options)).train()
        model.set_grad_checkpointing(checkpointed)
        model(*batch()).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_compiles_without_graph_breaks(options):
    model = randomized(create_model("DiT-S/2", topology="ancre", **KW, **options))
    explanation = torch._dynamo.explain(model)(*batch())
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


def test_checkpoints_record_the_options_and_old_specs_load_as_the_dit(tmp_path):
    from ancre_dit.checkpoint import load_trained_model, make_model_spec, write_model_files

    kwargs = dict(KW, topology="ancre", **MODERN)
    model = randomized(create_model("DiT-S/2", **kwargs))
    write_model_files(tmp_path / "new", make_model_spec("DiT-S/2", kwargs, {}, {}, 1), model.state_dict())
    loaded, spec = load_trained_model(tmp_path / "new", "model")
    assert {k: spec["model"]["kwargs"][k] for k in MODERN} == MODERN
    torch.testing.assert_close(loaded(*batch()), model(*batch()))
    old = dict(KW, topology="ancre")  # a spec written before the options existed
    plain = randomized(create_model("DiT-S/2", **old))
    write_model_files(tmp_path / "old", make_model_spec("DiT-S/2", old, {}, {}, 1), plain.state_dict())
    loaded, _ = load_trained_model(tmp_path / "old", "model")
    assert loaded.blocks[0].rope is None and isinstance(loaded.blocks[0].norm1, torch.nn.LayerNorm)
    torch.testing.assert_close(loaded(*batch()), plain(*batch()))


def test_bad_block_options_are_one_line(tmp_path):
    from helpers import tiny_config

    with pytest.raises(UserError, match="unknown mlp 'relu'"):
        create_model("DiT-S/2", mlp="relu", **KW)
    with pytest.raises(UserError, match="unknown norm 'batchnorm'; choose one of layernorm, rmsnorm"):
        tiny_config(tmp_path, "model.norm=batchnorm")
    config = tiny_config(tmp_path, "model.pos_embed=rope2d", "model.qk_norm=true")
    assert (config.model.pos_embed, config.model.qk_norm) == ("rope2d", True)


@pytest.mark.slow
def test_the_modern_block_trains_resumes_and_samples(tmp_path):
    import numpy as np

    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.sampling.api import sample_images

    from helpers import train_straight_and_resumed

    options = [f"model.{k}={str(v).lower()}" for k, v in MODERN.items()]
    model, spec = load_trained_model(train_straight_and_resumed(tmp_path, *options, "train.ckpt_every=2"))
    assert spec["model"]["kwargs"]["mlp"] == "swiglu"
    images = sample_images(model, spec["diffusion"], [1, 2], sampler="ddim", steps=3, seed=0)
    assert images.shape == (2, 8, 8, 1) and images.dtype == np.uint8
