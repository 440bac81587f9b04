"""Training loop: the loss falls, resume is bitwise exact, checkpoints survive crashes and signals,
and a checkpoint's trained-model files rebuild the EMA network."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (ROOT, accelerate_state, assert_same_weights, subprocess_env, tiny_config, tiny_overrides,
                     write_latent_dir)
from safetensors.torch import load_file

import ancre_dit.training.checkpointing as checkpointing_module
from ancre_dit.checkpoint import load_trained_model
from ancre_dit.training import Trainer, train
from ancre_dit.training.checkpointing import list_checkpoints, resolve_resume

# Every test here trains (in process or through train.py): seconds to minutes each.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate")]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{step:07d}"


def _assert_same_state(a: Path, b: Path) -> None:
    assert_same_weights(a, b)
    oa = torch.load(a / "accelerate" / "optimizer.bin", weights_only=False)
    ob = torch.load(b / "accelerate" / "optimizer.bin", weights_only=False)
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) > 0
    for pid in oa["state"]:
        for key, value in oa["state"][pid].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][pid][key])), f"optimizer {pid}.{key}"


def test_loss_falls_on_digits(tmp_path):
    out = train(tiny_config(tmp_path / "run", "train.max_steps=240", "train.log_every=40", "train.global_batch_size=32",
                            "model.learn_sigma=false", "log.figures=true"))
    losses = [m["loss"] for m in _metrics(tmp_path / "run")]
    assert out["step"] == 240 and len(losses) == 6
    assert losses[-1] < 0.6 * losses[0], losses
    assert (tmp_path / "run" / "loss.png").is_file()


def test_resume_is_bitwise_exact_and_survives_a_crash_mid_save(tmp_path, monkeypatch):
    N = 3
    # Learned sigma and label dropout on: every random stream (t, noise, dropout) must be restored.
    common = ["train.ckpt_every=3", "model.learn_sigma=true", "model.class_dropout=0.1", "train.ema_warmup=true"]
    with accelerate_state():
        train(tiny_config(tmp_path / "straight", f"train.max_steps={2 * N}", *common))

    # N steps, then a new process-like start with --resume auto for N more.
    with accelerate_state():
        train(tiny_config(tmp_path / "split", f"train.max_steps={N}", *common))
    with accelerate_state():
        train(tiny_config(tmp_path / "split", f"train.max_steps={2 * N}", *common), resume="auto")
    _assert_same_state(_ckpt(tmp_path / "straight", 2 * N), _ckpt(tmp_path / "split", 2 * N))

    # A crash inside the second save, after Accelerate's files are written.
    real_write = checkpointing_module.write_model_files
    calls = []

    def crashing_write(folder, *args, **kwargs):
        calls.append(folder)
        real_write(folder, *args, **kwargs)
        if len(calls) == 2:
            raise RuntimeError("simulated crash mid-save")

    monkeypatch.setattr(checkpointing_module, "write_model_files", crashing_write)
    with accelerate_state(), pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tmp_path / "crash", f"train.max_steps={2 * N}", *common))
    monkeypatch.setattr(checkpointing_module, "write_model_files", real_write)
    ck = tmp_path / "crash" / "checkpoints"
    assert (ck / f".tmp-{2 * N:07d}").is_dir() and not _ckpt(tmp_path / "crash", 2 * N).exists()
    assert [s for s, _ in list_checkpoints(tmp_path / "crash")] == [N]
    assert resolve_resume("auto", tmp_path / "crash") == _ckpt(tmp_path / "crash", N)
    with accelerate_state():
        out = train(tiny_config(tmp_path / "crash", f"train.max_steps={2 * N}", *common), resume="auto")
    assert out["step"] == 2 * N
    assert not (ck / f".tmp-{2 * N:07d}").exists()
    _assert_same_state(_ckpt(tmp_path / "straight", 2 * N), _ckpt(tmp_path / "crash", 2 * N))


def test_checkpoint_files_rebuild_the_ema_model_and_keep_last_prunes(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run", "train.max_steps=4", "train.ckpt_every=1", "train.keep_last=2",
                                  "train.sample_every=4", "train.num_sample_images=10", "train.sample_steps=4",
                                  "log.tensorboard=true", "log.figures=true"))
    trainer.run()
    run = tmp_path / "run"
    assert [s for s, _ in list_checkpoints(run)] == [3, 4]  # keep_last=2
    model, spec = load_trained_model(_ckpt(run, 4), "ema")
    assert spec["step"] == 4 and spec["data"]["kind"] == "digits" and spec["data"]["image_size"] == 8
    ema = trainer.ema.module.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ema[k].cpu()), k
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 5, 9])
    trainer.ema.module.eval()
    assert torch.equal(model(x, t, y), trainer.ema.module(x, t, y))
    raw, _ = load_trained_model(_ckpt(run, 4), "model")
    assert all(torch.equal(v, trainer.raw_model.state_dict()[k]) for k, v in raw.state_dict().items())
    # the EMA moved away from the raw weights, and covers the topology logits too
    assert not torch.equal(ema["topology.logits.1"], trainer.raw_model.state_dict()["topology.logits.1"])
    topo = json.loads((_ckpt(run, 4) / "topology.json").read_text())
    assert torch.allclose(torch.tensor(topo["probabilities"]), model.topology.probabilities(), atol=1e-6)
    assert (_ckpt(run, 4) / "topology.png").is_file() and (run / "samples" / "0000004.png").is_file()
    assert (run / "config.yaml").is_file() and "checkpoints" in (run / "log.txt").read_text()
    assert list((run / "logs").rglob("events.out.tfevents*")), "no TensorBoard events"


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_copies_the_model_and_follows_timms_schedule(warmup):
    """The EMA's decay per update is timm ModelEmaV3's (with warm-up its 1 - (1 + n)^(-2/3) ramp
    capped at the set decay), so paired and resumed runs average as they did with timm's."""
    from timm.utils import ModelEmaV3

    from ancre_dit.training.ema import EMA, ema_update_
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ours, theirs = EMA(model, 0.999, warmup=warmup), ModelEmaV3(model, decay=0.999, use_warmup=warmup)
    assert not ours.module.training and not any(p.requires_grad for p in ours.module.parameters())
    assert [ours.decay(n) for n in range(3000)] == [theirs.get_decay(n + 1 if warmup else None) for n in range(3000)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()(torch.randn(5, 3))  # moves the BatchNorm statistics and its step counter
    ema_update_(ours, model, 7, None)
    theirs.update(model, 8 if warmup else None)
    for k, v in ours.module.state_dict().items():
        torch.testing.assert_close(v, theirs.module.state_dict()[k], rtol=0, atol=1e-7, msg=k)


def test_figures_off_writes_the_data_and_no_png(tmp_path):
    """log.figures=false: topology.json in the run and its checkpoint, the jsonl logs, and no PNG
    (no heatmap, loss, quality or diagnostics figure); the weights are those of a run with figures."""
    for name, figures in (("off", "false"), ("on", "true")):
        with accelerate_state():
            train(tiny_config(tmp_path / name, "train.max_steps=2", "train.ckpt_every=2", "train.eval_every=2",
                              "eval.num_samples=4", "eval.batch_size=4", "eval.steps=2", "train.diagnostics=true",
                              f"log.figures={figures}"))
    off, on = tmp_path / "off", tmp_path / "on"
    assert (off / "topology.json").is_file() and (_ckpt(off, 2) / "topology.json").is_file()
    assert (off / "logs" / "evals.jsonl").is_file() and (off / "logs" / "diagnostics.jsonl").is_file()
    assert sorted(p.name for p in off.rglob("*.png")) == []
    assert sorted(p.name for p in on.rglob("*.png")) == ["diagnostics.png", "loss.png", "quality.png", "topology.png",
                                                         "topology.png"]
    assert_same_weights(_ckpt(off, 2), _ckpt(on, 2))


def test_sigterm_writes_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    overrides = tiny_overrides(f"run_dir={run}", "train.max_steps=100000", "train.ckpt_every=100000")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            log = run / "log.txt"
            if log.is_file() and "step 2:" in log.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        # A scheduler may repeat its SIGTERM: every 20 ms until the process has gone, which must
        # still save once and exit 0 (not -15 after "done").
        while proc.poll() is None and time.time() < deadline + 120:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    found = list_checkpoints(run)
    assert len(found) == 1 and found[0][0] >= 2
    step, folder = found[0]
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
    model, spec = load_trained_model(folder)
    assert spec["step"] == step
    assert "stop requested" in (run / "log.txt").read_text()


def _tiny_latent_dir(root: Path, n: int = 24, shape=(4, 4, 4)) -> Path:
    """Random moments of 3 classes in two shards."""
    g = torch.Generator().manual_seed(0)
    shards = [{"mean": torch.randn(count, 2, *shape, generator=g).half(),
               "std": (0.1 * torch.rand(count, 2, *shape, generator=g)).half(),
               "label": torch.arange(count) % 3, "index": torch.arange(count) + k * (n // 2)}
              for k, count in enumerate((n // 2, n - n // 2))]
    return write_latent_dir(root, shards, num_classes=3, image_size=8 * shape[1])


def test_trains_on_latent_shards(tmp_path):
    latents = _tiny_latent_dir(tmp_path / "latents")
    run = tmp_path / "run"
    train(tiny_config(run, "data.kind=latents", f"data.path={latents}", "data.image_size=32", "train.max_steps=2",
                      "train.global_batch_size=8", "train.ckpt_every=2", "train.sample_every=2"))
    model, spec = load_trained_model(_ckpt(run, 2))
    assert (model.in_channels, model.input_size, model.num_classes) == (4, 4, 3)
    assert spec["data"] == {"kind": "latents", "image_size": 32, "image_channels": 3, "num_classes": 3, "vae": None,
                            "scaling_factor": 0.18215}
    assert "no sample grids" in (run / "log.txt").read_text()  # no VAE named: grids are skipped, training goes on


@pytest.mark.parametrize("topology", ["denseformer", "hc", "mhc"])
def test_peer_topologies_train_checkpoint_and_sample(tmp_path, topology):
    """The peer schemes go through training, EMA, checkpoints and sampling; HC / mHC have
    no (K, K) matrix, so no topology heatmap is drawn for them."""
    from ancre_dit.sampling.api import sample_images

    run = tmp_path / topology
    out = train(tiny_config(run, f"model.topology={topology}", "model.hc_streams=3", "train.max_steps=3",
                            "train.ckpt_every=3", "log.figures=true"))
    assert out["step"] == 3
    folder = _ckpt(run, 3)
    model, spec = load_trained_model(folder)
    assert spec["model"]["kwargs"]["topology"] == topology
    ema = load_file(str(folder / "ema.safetensors"))
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())
    assert (folder / "topology.png").is_file() == (topology == "denseformer")
    if topology != "denseformer":
        assert model.topology.streams == 3
    images = sample_images(model, spec["diffusion"], [1, 2], sampler="ddim", steps=3, seed=0)
    assert images.shape == (2, 8, 8, 1) and images.dtype == np.uint8
