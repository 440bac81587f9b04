"""DDPM through the objective interface computes what it did before objectives existed.

The constants come from the code as it was before the interface, on the same tiny seeded
model with torch 2.14.1, where they matched bit for bit. Another CPU rounds differently (another
vector width or matrix-kernel blocking changes the order of float additions), so the pins hold
to a relative tolerance set well above that rounding and far below any change of formula: the
per-sample loss terms and the training losses keep their original values; the 250-step samples
and the trained weights (whose original pins were hashes) are pinned by summaries recorded on an
AVX-512 CPU and checked against a build forced onto SSE4.2 kernels (largest gaps: 1e-6 relative on
the samples, 7e-5 on the norm of a tensor still near its zero init, 3e-5 absolute on the logits).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_DIT, TINY_NAME, tiny_config

from ancre_dit.diffusion import build_objective
from ancre_dit.models import create_model
from ancre_dit.sampling import Guidance, sample_latents
from ancre_dit.training import train

DDPM_SPEC = dict(objective="ddpm", num_timesteps=1000, beta_start=1e-4, beta_end=0.02, learn_sigma=True)
TINY = {**TINY_DIT, "learn_sigma": True}
BEFORE = {  # float.hex of the per-sample terms, in batch order
    "loss": ["0x1.bfc3820000000p+0", "0x1.8193740000000p+0", "0x1.442f200000000p+1", "0x1.ce37360000000p+0",
             "0x1.b7cd9e0000000p+0", "0x1.b5c58c0000000p+0"],
    "mse": ["0x1.ba7d440000000p+0", "0x1.7b82280000000p+0", "0x1.4147c40000000p+1", "0x1.c9a9920000000p+0",
            "0x1.b479c00000000p+0", "0x1.b2854c0000000p+0"],
    "vb": ["0x1.518fa20000000p-6", "0x1.8453080000000p-6", "0x1.73ad8e0000000p-6", "0x1.2369360000000p-6",
           "0x1.a9eea40000000p-7", "0x1.a0204a0000000p-7"],
}
BEFORE_T = [810, 90, 186, 671, 258, 439]
DDPM250 = {"first": [-55.144805908203125, -144.56251525878906, -16.699186325073242, -419.2828674316406,
                     248.0840301513672, -97.63854217529297, 160.62298583984375, -154.2509002685547],
           "mean": -61.6579609522596, "mean_abs": 233.02192301210016}
BEFORE_TRAIN_LOSSES = ["0x1.ea26d80000000p-1", "0x1.0d1f840000000p+0", "0x1.0336000000000p+0"]
TRAIN_WEIGHT_NORMS = {
    "blocks.0.adaLN_modulation.1.bias": 0.013600887,
    "blocks.0.adaLN_modulation.1.weight": 0.0546075553,
    "blocks.0.attn.proj.bias": 0.00332562828,
    "blocks.0.attn.proj.weight": 5.75825785,
    "blocks.0.attn.qkv.bias": 0.00377523339,
    "blocks.0.attn.qkv.weight": 6.89029714,
    "blocks.0.mlp.fc1.bias": 0.00558361136,
    "blocks.0.mlp.fc1.weight": 7.15574376,
    "blocks.0.mlp.fc2.bias": 0.00332644909,
    "blocks.0.mlp.fc2.weight": 7.1387728,
    "blocks.1.adaLN_modulation.1.bias": 0.0130387526,
    "blocks.1.adaLN_modulation.1.weight": 0.0521112585,
    "blocks.1.attn.proj.bias": 0.00320692009,
    "blocks.1.attn.proj.weight": 5.74252351,
    "blocks.1.attn.qkv.bias": 0.00360429616,
    "blocks.1.attn.qkv.weight": 6.92432631,
    "blocks.1.mlp.fc1.bias": 0.00491818844,
    "blocks.1.mlp.fc1.weight": 7.16657081,
    "blocks.1.mlp.fc2.bias": 0.00321079315,
    "blocks.1.mlp.fc2.weight": 7.10254963,
    "final_layer.adaLN_modulation.1.bias": 0.0104433424,
    "final_layer.adaLN_modulation.1.weight": 0.0535718489,
    "final_layer.linear.bias": 0.00694385235,
    "final_layer.linear.weight": 0.0427848705,
    "pos_embed": 16.0,
    "t_embedder.mlp.0.bias": 0.00345888785,
    "t_embedder.mlp.0.weight": 1.81291249,
    "t_embedder.mlp.2.bias": 0.00358250866,
    "t_embedder.mlp.2.weight": 0.652311396,
    "topology.logits.0": 0.0,
    "topology.logits.1": 0.00147521271,
    "topology.tau": 0.00999999978,
    "x_embedder.proj.bias": 0.0088755796,
    "x_embedder.proj.weight": 2.5693854,
    "y_embedder.embedding_table.weight": 0.388615282,
}
LOSS_REL = 1e-5  # the loss pins held to 4e-7 on another CPU
SAMPLE_REL = 1e-5
NORM_REL, NORM_ABS = 1e-3, 1e-4


def approx_hex(values, pins, rel: float) -> bool:
    return len(values) == len(pins) and all(
        abs(float(v) - float.fromhex(p)) <= rel * abs(float.fromhex(p)) for v, p in zip(values, pins))


def seeded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(TINY_NAME, **TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    return model.eval()


def test_ddpm_losses_and_ddpm250_samples_are_unchanged():
    torch.set_num_threads(1)
    model = seeded_model()
    g = torch.Generator().manual_seed(123)
    x = torch.randn(6, 1, 8, 8, generator=g).clamp(-1, 1)
    y = torch.arange(6)
    objective = build_objective(DDPM_SPEC)
    draws = objective.draw(x, g)  # the trainer's draw: integer timesteps, then noise, from one generator
    assert draws[0].tolist() == BEFORE_T
    terms = objective.losses(model, x, y, draws)
    for key, values in BEFORE.items():
        assert approx_hex(terms[key].detach().tolist(), values, LOSS_REL), (key, [float(v).hex() for v in terms[key]])
    samples = sample_latents(model, DDPM_SPEC, [3, 1, 4, 1], seed=5, steps=250, guidance=Guidance(2.0)).double()
    assert samples.flatten()[:8].tolist() == pytest.approx(DDPM250["first"], rel=SAMPLE_REL)
    assert float(samples.mean()) == pytest.approx(DDPM250["mean"], rel=SAMPLE_REL)
    assert float(samples.abs().mean()) == pytest.approx(DDPM250["mean_abs"], rel=SAMPLE_REL)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_ddpm_training_is_unchanged(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    # The pin is about the objective. The tiny run is ANCRe, whose eager aggregation is now the
    # stacked form that rounds differently from the addcmul chain it had then (test_grad_checkpointing
    # checks the two agree); the chain is what produced the pinned numbers.
    from ancre_dit.models.topologies import WeightedHistoryTopology
    monkeypatch.setattr(WeightedHistoryTopology, "use_chain", True)
    run = tmp_path / "run"
    train(tiny_config(run, "train.max_steps=3", "train.ckpt_every=3", "model.learn_sigma=true",
                      "model.class_dropout=0.1"))
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert approx_hex([r["loss"] for r in rows], BEFORE_TRAIN_LOSSES, LOSS_REL), [float(r["loss"]).hex() for r in rows]
    weights = load_file(str(run / "checkpoints" / "0000003" / "model.safetensors"))
    norms = {key: float(value.double().norm()) for key, value in sorted(weights.items())}
    assert norms.keys() == TRAIN_WEIGHT_NORMS.keys()
    for key, norm in norms.items():
        assert norm == pytest.approx(TRAIN_WEIGHT_NORMS[key], rel=NORM_REL, abs=NORM_ABS), key
    spec = json.loads((run / "checkpoints" / "0000003" / "model_spec.json").read_text())
    assert spec["diffusion"] == DDPM_SPEC
