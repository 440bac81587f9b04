"""DDPM through the objective interface is bitwise what it was before objectives existed.

The constants were computed with the code at commit 6540a01 (before the interface) on the same
tiny seeded model, with torch 2.14.1 on the project's x86-64 CPU; exact float equality depends on
that torch build and CPU, like every bitwise check here.
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file

from helpers import TINY_DIT, TINY_NAME, reset_accelerate, tiny_config

from ancre_dit.diffusion import build_objective
from ancre_dit.models import create_model
from ancre_dit.sampling import Guidance, sample_latents
from ancre_dit.training import train

LEGACY_SPEC = dict(num_timesteps=1000, beta_start=1e-4, beta_end=0.02, learn_sigma=True)
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
BEFORE_DDPM250_SHA256 = "01981ec71824b468b0346a816a09a4d5a86109ada408b64475a9d1d1230f3c1b"
BEFORE_TRAIN_LOSSES = ["0x1.ea26d80000000p-1", "0x1.0d1f840000000p+0", "0x1.0336000000000p+0"]
BEFORE_TRAIN_WEIGHTS_SHA256 = "215bfedd2d8f6e19e98f50fb6adf0a6a0c72e738b1a6e1bafd30f0dbbe538e6f"


def seeded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(TINY_NAME, **TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    return model.eval()


def test_ddpm_losses_and_ddpm250_samples_are_bitwise_unchanged():
    torch.set_num_threads(1)
    model = seeded_model()
    g = torch.Generator().manual_seed(123)
    x = torch.randn(6, 1, 8, 8, generator=g).clamp(-1, 1)
    y = torch.arange(6)
    objective = build_objective(LEGACY_SPEC)
    draws = objective.draw(x, g)  # the trainer's draw: integer timesteps, then noise, from one generator
    assert draws[0].tolist() == BEFORE_T
    terms = objective.losses(model, x, y, draws)
    for key, values in BEFORE.items():
        assert [float(v).hex() for v in terms[key].detach()] == values, key
    samples = sample_latents(model, LEGACY_SPEC, [3, 1, 4, 1], seed=5, steps=250, guidance=Guidance(2.0))
    assert hashlib.sha256(samples.contiguous().numpy().tobytes()).hexdigest() == BEFORE_DDPM250_SHA256


def test_ddpm_training_is_bitwise_unchanged(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    # The pin is about the objective. The tiny run is ANCRe, whose eager aggregation is now a fused
    # sum that rounds differently from the addcmul chain it had then (test_grad_checkpointing
    # checks the two agree); the chain is what produced the pinned numbers.
    from ancre_dit.models.topologies import WeightedHistoryTopology
    monkeypatch.setattr(WeightedHistoryTopology, "fused_aggregation", False)
    run = tmp_path / "run"
    try:
        reset_accelerate()
        train(tiny_config(run, "train.max_steps=3", "train.ckpt_every=3", "model.learn_sigma=true",
                          "model.class_dropout=0.1"))
    finally:
        reset_accelerate()
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [float(r["loss"]).hex() for r in rows] == BEFORE_TRAIN_LOSSES
    weights = load_file(str(run / "checkpoints" / "0000003" / "model.safetensors"))
    digest = hashlib.sha256()
    for key in sorted(weights):
        digest.update(weights[key].contiguous().numpy().tobytes())
    assert digest.hexdigest() == BEFORE_TRAIN_WEIGHTS_SHA256
    spec = json.loads((run / "checkpoints" / "0000003" / "model_spec.json").read_text())
    assert spec["diffusion"] == {"objective": "ddpm", **LEGACY_SPEC}
