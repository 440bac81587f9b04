"""Every named recipe is its source's: each ImageNet config is held to a table of its source's
defining settings, read off the source's training script and configs, so that an edit cannot
drift from the source silently. A deliberate difference is in the table's DIFFERS and in the
config's header, with its reason."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from ancre_dit.training.config import load_config

# setting (section.key of our config) -> the source's value
SOURCES: dict[str, dict[str, object]] = {
    # DiT train.py: AdamW(lr=1e-4, weight_decay=0), global batch 256, update_ema decay 0.9999, no
    # clipping or warm-up; create_diffusion: 1000 linear-beta steps, learn_sigma; class_dropout_prob 0.1.
    "dit": {"diffusion.objective": "ddpm", "model.learn_sigma": True, "model.class_dropout": 0.1,
            "train.lr": 1e-4, "train.weight_decay": 0.0, "train.adam_beta1": 0.9, "train.adam_beta2": 0.999,
            "train.global_batch_size": 256, "train.ema_decay": 0.9999, "train.grad_clip": 0.0,
            "train.warmup_steps": 0, "model.norm": "layernorm", "model.mlp": "gelu", "model.pos_embed": "sincos",
            "model.qk_norm": False},
    # SiT train.py with transport defaults: path Linear, prediction velocity, loss_weight None, uniform
    # time; the rest as DiT's.
    "sit": {"diffusion.objective": "flow", "diffusion.time_sampling": "uniform", "diffusion.cosine_loss_weight": 0.0,
            "model.class_dropout": 0.1, "train.lr": 1e-4, "train.weight_decay": 0.0, "train.adam_beta2": 0.999,
            "train.global_batch_size": 256, "train.ema_decay": 0.9999, "train.grad_clip": 0.0,
            "model.norm": "layernorm", "model.mlp": "gelu", "model.pos_embed": "sincos", "model.qk_norm": False},
    # REPA train.py defaults: --learning-rate 1e-4, --adam-beta1/2 0.9/0.999, --adam-weight-decay 0,
    # --max-grad-norm 1.0, --batch-size 256, --max-train-steps 400000, --path-type linear,
    # --prediction v, --weighting uniform, --cfg-prob 0.1, --enc-type dinov2-vit-b, --proj-coeff 0.5,
    # --encoder-depth 8, projector_dim 2048, --qk-norm off; update_ema decay 0.9999.
    "repa": {"diffusion.objective": "flow", "diffusion.time_sampling": "uniform", "model.class_dropout": 0.1,
             "train.lr": 1e-4, "train.adam_beta1": 0.9, "train.adam_beta2": 0.999, "train.weight_decay": 0.0,
             "train.grad_clip": 1.0, "train.global_batch_size": 256, "train.max_steps": 400000,
             "train.ema_decay": 0.9999, "repa.weight": 0.5, "repa.depth": 8, "repa.projector_dim": 2048,
             "repa.encoder": "vit_base_patch14_dinov2.lvd142m", "model.qk_norm": False},
    # LightningDiT train.py and configs/reproductions/lightningdit_xl_vavae_f16d32_*.yaml: use_qknorm
    # false, use_swiglu / use_rope / use_rmsnorm true (RoPE beside the absolute sin-cos embedding);
    # transport Linear, velocity, use_lognorm (logit-normal 0, 1), use_cosine_loss (cos + mse);
    # AdamW(lr 2e-4, betas (0.9, 0.95), weight_decay 0), no max_grad_norm, update_ema decay 0.9999.
    "lightningdit": {"diffusion.objective": "flow", "diffusion.time_sampling": "logit-normal",
                     "diffusion.logit_mean": 0.0, "diffusion.logit_std": 1.0, "diffusion.cosine_loss_weight": 1.0,
                     "model.norm": "rmsnorm", "model.mlp": "swiglu", "model.pos_embed": "sincos+rope2d",
                     "model.qk_norm": False, "model.class_dropout": 0.1, "train.lr": 2e-4, "train.adam_beta1": 0.9,
                     "train.adam_beta2": 0.95, "train.weight_decay": 0.0, "train.grad_clip": 0.0,
                     "train.ema_decay": 0.9999},
}
# The XL/1 headline recipe adds its model and data: LightningDiT-XL/1 (28 x 1152, patch 1) on 32-channel
# VA-VAE latents normalised per channel (latent_norm true, latent_multiplier 1), global batch 1024,
# max_steps 80000.
XL1 = {**SOURCES["lightningdit"], "model.name": "DiT-XL/2", "model.patch_size": 1, "data.latent_norm": "channel",
       "train.global_batch_size": 1024, "train.max_steps": 80000}
# Deliberate differences, each said in the config's header: bf16 autocast (DiT and SiT train in fp32,
# REPA in fp16) and torch.compile for speed; learn_sigma off for SiT (its sigma channels never train).
DIFFERS = {"train.mixed_precision": "bf16", "train.compile": True}

RECIPES = {"dit-s2": "dit", "dit-b2": "dit", "sit-s2": "sit", "sit-b2": "sit", "repa-sit-b2": "repa",
           "repa-sit-xl2": "repa", "lightningdit-s2": "lightningdit", "lightningdit-b2": "lightningdit",
           "lightningdit-xl1": "lightningdit-xl1"}
IMAGENET_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                          if yaml.safe_load(p.read_text())["data"]["kind"] == "latents")


def _value(config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _load(path: Path, tmp_path: Path):
    (tmp_path / "lat").mkdir(exist_ok=True)
    overrides = [f"data.path={tmp_path / 'lat'}"]
    if "repa" in yaml.safe_load(path.read_text()):  # its encoder's weights file is checked at load
        (tmp_path / "dinov2.pth").touch()
        overrides.append(f"repa.encoder_weights={tmp_path / 'dinov2.pth'}")
    return load_config(path, overrides)


def test_every_imagenet_config_names_a_source_in_the_table():
    for path in IMAGENET_CONFIGS:
        recipe = path.stem.rsplit("-", 1)[0]
        assert recipe in RECIPES, f"{path.name}: add its source's settings to test_recipes.SOURCES"
        header = path.read_text().split("run_dir:")[0]
        assert "# Source: " in header and "Follows: " in header and "Differs: " in header, path.name


@pytest.mark.parametrize("path", IMAGENET_CONFIGS, ids=lambda p: p.stem)
def test_each_recipe_holds_its_sources_settings(path, tmp_path):
    recipe = RECIPES[path.stem.rsplit("-", 1)[0]]
    wanted = {**(XL1 if recipe == "lightningdit-xl1" else SOURCES[recipe]), **DIFFERS}
    config = _load(path, tmp_path)
    got = {key: _value(config, key) for key in wanted}
    assert got == wanted, {k: (got[k], wanted[k]) for k in wanted if got[k] != wanted[k]}
    assert config.model.topology in path.stem
    if recipe == "sit" or recipe == "repa":
        assert config.model.learn_sigma is False  # the deliberate difference its header explains
