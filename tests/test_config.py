"""Config: YAML + overrides into typed sections; every mistake is one clear line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, subprocess_env

from ancre_dit.errors import UserError
from ancre_dit.training.config import check_batch_layout, load_config, save_config
from ancre_dit.training.data import GlobalBatchSampler, advance_position, build_data

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_shipped_configs_load(tmp_path):
    names = {p.stem for p in CONFIGS}
    assert {"dit-s2-ancre", "dit-s2-cascaded", "dit-b2-ancre", "dit-b2-cascaded", "digits-ancre", "digits-cascaded"} <= names
    for path in CONFIGS:
        raw = yaml.safe_load(path.read_text())
        if raw["data"]["kind"] == "latents":  # the paper recipe; its data path is checked at load
            (tmp_path / "lat").mkdir(exist_ok=True)
            c = load_config(path, [f"data.path={tmp_path / 'lat'}"])
            assert (c.train.global_batch_size, c.train.max_steps, c.train.lr, c.train.ema_decay) == (256, 400000, 1e-4, 0.9999)
            # learn_sigma: on for DiT's DDPM, off for SiT's flow objective (sit-*.yaml).
            assert (c.train.mixed_precision, c.train.ckpt_every, c.model.tau, c.model.learn_sigma, c.model.class_dropout) == \
                ("bf16", 50000, 0.01, c.diffusion.objective == "ddpm", 0.1)
            assert c.diffusion.objective == ("flow" if path.stem.startswith("sit-") else "ddpm")
        else:
            c = load_config(path)
            assert c.data.kind == "digits" and c.train.mixed_precision == "no"
        # the name says the topology; quickstart.yaml is the README's first command, with ANCRe
        assert c.model.topology in path.stem or (path.stem == "quickstart" and c.model.topology == "ancre")


def test_overrides_types_and_round_trip(tmp_path):
    c = load_config(ROOT / "configs" / "digits-ancre.yaml",
                    ["train.max_steps=20", "train.lr=1e-4", "model.depth=3", "run_dir=results/x", "train.grad_clip=2", "log.wandb=false"])
    assert (c.train.max_steps, c.train.lr, c.model.depth, c.run_dir, c.train.grad_clip) == (20, 1e-4, 3, "results/x", 2.0)
    assert isinstance(c.train.lr, float) and isinstance(c.train.grad_clip, float)
    save_config(c, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == c


@pytest.mark.parametrize("overrides, message", [
    (["train.max_step=5"], "unknown config key train.max_step"),
    (["optim.lr=1"], "unknown config key optim"),
    (["train.max_steps=ten"], "config key train.max_steps must be int"),
    (["train.max_steps=2.5"], "config key train.max_steps must be int"),
    (["model.learn_sigma=3"], "config key model.learn_sigma must be bool"),
    (["model.name=DiT-Q/2"], "unknown model 'DiT-Q/2'"),
    (["model.topology=spaghetti"], "unknown topology"),
    (["data.kind=latents", "data.path=/nonexistent/latents"], "data path /nonexistent/latents does not exist"),
    (["data.kind=images"], "data.kind=images needs data.path"),
    (["train.mixed_precision=fp8"], "train.mixed_precision must be one of"),
    (["train.max_steps"], "is not key=value"),
])
def test_bad_configs_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as err:
        load_config(ROOT / "configs" / "digits-ancre.yaml", overrides)
    assert "\n" not in str(err.value)


def test_batch_layout_and_patch_checks(tmp_path):
    c = load_config(None, ["data.kind=digits", "data.image_size=8", "train.global_batch_size=24", "train.grad_accum=2"])
    assert check_batch_layout(c, 3) == 4
    with pytest.raises(UserError, match="not divisible by 5 process"):
        check_batch_layout(c, 5)
    # an image folder whose size the patch size does not divide
    from PIL import Image
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        Image.new("RGB", (12, 12)).save(tmp_path / "imgs" / cls / "0.png")
    c = load_config(None, ["data.kind=images", f"data.path={tmp_path / 'imgs'}", "data.image_size=10", "model.name=DiT-S/4"])
    with pytest.raises(UserError, match="data.image_size 10 is not divisible by the patch size 4"):
        build_data(c, 4)
    assert build_data(c, 2).num_classes == 2


def test_data_order_is_the_same_global_batch_for_any_layout():
    def global_batches(world, accum, steps, epoch=0, offset=0):
        its = [iter(GlobalBatchSampler(50, 12, world, r, accum, seed=7, epoch=epoch, offset=offset)) for r in range(world)]
        out = []
        for _ in range(steps):
            out.append(sorted(i for it in its for _ in range(accum) for i in next(it)))
        return out

    one = global_batches(1, 1, 9)
    assert one == global_batches(2, 1, 9) == global_batches(2, 3, 9) == global_batches(4, 1, 9)
    assert len(set(i for b in one[:4] for i in b)) == 48  # an epoch: 4 disjoint batches (2 dropped)
    assert one[:4] != one[4:8]  # a new permutation each epoch
    # resuming from a saved position continues the same stream
    epoch, offset = 0, 0
    for _ in range(6):
        epoch, offset = advance_position(epoch, offset, 12, 50)
    assert global_batches(2, 1, 3, epoch, offset) == one[6:9]


@pytest.mark.slow
def test_bad_configs_from_the_command_line(tmp_path):
    """train.py prints one line starting with 'error:' for each mistake named in the issue."""
    cases = {
        "unknown model": ["model.name=DiT-Z/2"],
        "not divisible": ["train.global_batch_size=10", "train.grad_accum=4"],
        "does not exist": ["data.kind=latents", f"data.path={tmp_path / 'missing'}"],
    }
    procs = {
        key: subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
                               f"run_dir={tmp_path / key.replace(' ', '_')}", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
        for key, args in cases.items()
    }
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (key, err)
        assert len(lines) == 1 and lines[0].startswith("error:") and key in lines[0], (key, err)
