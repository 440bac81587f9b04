"""Fault injection: kill -9 a tiny training run (at random moments and during checkpoint
writes), a sampling job and a latent extraction, several times each, rerunning the same command
after each kill; the final outputs must be bitwise identical to an uninterrupted run, and what a
kill leaves behind is never taken for complete (every checkpoint --resume auto could pick loads).

The kill moments come from a seeded RNG, so a failure can be replayed; each test reports
"kills survived / kills tried" on stdout (pytest -s) for BENCHMARKS.md.
"""
from __future__ import annotations

import filecmp
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import ROOT, TINY_TRAIN, subprocess_env

from ancre_dit.checkpoint import load_trained_model  # noqa: E402
from ancre_dit.training.checkpointing import checkpoint_problem, list_checkpoints  # noqa: E402

KILLS = 3          # kills per job at random moments (plus, for training, 2 timed to land in a checkpoint write)
SEED = 14


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=ROOT)


def _finish(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _count(folder: Path, pattern: str) -> Callable[[], int]:
    return lambda: sum(1 for _ in folder.glob(pattern)) if folder.is_dir() else 0


def _progress_kill(rng: random.Random, counter: Callable[[], int], jitter: float = 0.5) -> tuple[Callable[[], bool], float]:
    """A random moment of a job: after 0-2 more units of progress (steps, parts, shards; 0 = during
    start-up), plus a random fraction of a second. Progress-based so that a kill lands whatever the
    machine's speed, and the job always has work left when it comes."""
    target = counter() + rng.randint(0, 2)
    return (lambda: counter() >= target), rng.uniform(0.0, jitter)


def _kill_after(cmd: list[str], until: Callable[[], bool], extra: float = 0.0) -> bool:
    """Starts `cmd` and SIGKILLs it `extra` seconds after `until()` holds. Returns True when the
    kill landed (False: the job had already finished)."""
    proc = _start(cmd)
    try:
        while proc.poll() is None and not until():
            time.sleep(0.005)
        time.sleep(extra)
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            return False
        proc.kill()
        proc.wait(timeout=60)
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _same_tree(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> None:
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and not p.name.startswith(ignore))
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and not p.name.startswith(ignore))
    assert files_a == files_b
    match, mismatch, errors = filecmp.cmpfiles(a, b, files_a, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


# -- training ----------------------------------------------------------------------------------
def _train_cmd(run: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"), *TINY_TRAIN,
            f"run_dir={run}", "train.max_steps=16", "train.ckpt_every=2", "train.keep_last=2", "train.log_every=1",
            "--resume", "auto"]


def _assert_every_checkpoint_sound(run: Path) -> None:
    """What --resume auto may pick after a kill: complete folders only, each one loading back."""
    for step, folder in list_checkpoints(run):
        assert checkpoint_problem(folder) is None, folder
        model, spec = load_trained_model(folder)
        assert spec["step"] == step


def _final_state(run: Path) -> dict[str, bytes]:
    last = run / "checkpoints" / "0000016"
    names = ["model.safetensors", "ema.safetensors", "accelerate/optimizer.bin",
             "rng/rank0.pt", "trainer_state.json", "topology.json"]
    state = {n: (last / n).read_bytes() for n in names}
    # Wall-clock training seconds are bookkeeping, not training state: the rest must match bitwise.
    trainer_state = json.loads(state["trainer_state.json"])
    trainer_state.pop("train_seconds", None)
    state["trainer_state.json"] = json.dumps(trainer_state, sort_keys=True).encode()
    return state


@pytest.mark.slow
def test_training_survives_kill_9_anywhere(tmp_path):
    rng = random.Random(SEED)
    reference = tmp_path / "reference"
    _finish(_train_cmd(reference))
    run = tmp_path / "killed"
    steps_done = lambda: len((run / "logs" / "metrics.jsonl").read_text().splitlines()) \
        if (run / "logs" / "metrics.jsonl").is_file() else 0  # noqa: E731 - log_every=1: one line per step
    saving = lambda: any(True for _ in (run / "checkpoints").glob(".tmp-*"))  # noqa: E731
    tried = landed = 0
    # Random moments (start-up, steps, saves), then kills timed to land while a checkpoint is
    # being written (its .tmp- folder exists).
    for k in range(KILLS + 2):
        until, extra = _progress_kill(rng, steps_done) if k < KILLS else (saving, rng.uniform(0.0, 0.05))
        landed += _kill_after(_train_cmd(run), until, extra)
        tried += 1
        _assert_every_checkpoint_sound(run)
    _finish(_train_cmd(run))
    _assert_every_checkpoint_sound(run)
    reference_state, killed_state = _final_state(reference), _final_state(run)
    for name, data in reference_state.items():
        assert killed_state[name] == data, f"{name} differs from the uninterrupted run"
    assert landed == tried, f"only {landed} of {tried} kills landed while the job ran"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    print(f"\ntraining: {landed} kills landed of {tried} tried, all survived (final checkpoint bitwise identical)")


# -- sampling ------------------------------------------------------------------------------------
def _sample_cmd(ckpt: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(ckpt), "--num-samples", "12", "--batch-size", "2",
            "--sampler", "ddpm", "--steps", "20", "--out", str(out), "--cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sampling-run")
    _finish([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"), *TINY_TRAIN,
             f"run_dir={run}", "train.max_steps=2", "train.ckpt_every=2"])
    return run / "checkpoints" / "0000002"


@pytest.mark.slow
def test_sampling_survives_kill_9_anywhere(checkpoint, tmp_path):
    rng = random.Random(SEED + 1)
    reference = tmp_path / "reference.npz"
    _finish(_sample_cmd(checkpoint, reference))
    out = tmp_path / "killed.npz"
    parts = out.with_name("killed.parts")
    tried = landed = 0
    for _ in range(KILLS):
        landed += _kill_after(_sample_cmd(checkpoint, out), *_progress_kill(rng, _count(parts, "part-*.npz")))
        tried += 1
        for part in parts.glob("part-*.npz"):  # every part a rerun would keep is a whole, loadable file
            with np.load(part) as data:
                assert len(data["arr_0"]) == 2
    _finish(_sample_cmd(checkpoint, out))
    assert out.read_bytes() == reference.read_bytes()
    assert not out.with_name("killed.parts").exists()
    assert landed == tried, f"only {landed} of {tried} kills landed while the job ran"
    print(f"\nsampling: {landed} kills landed of {tried} tried, all survived (merged npz bitwise identical)")


# -- latent extraction ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def extraction_inputs(tmp_path_factory) -> tuple[Path, Path]:
    from diffusers import AutoencoderKL

    root = tmp_path_factory.mktemp("extract")
    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        (root / "images" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(root / "images" / c / f"{i}.png")
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=32).save_pretrained(root / "vae")
    return root / "images", root / "vae"


def _extract_cmd(images: Path, vae: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "extract_latents.py"), "--data-path", str(images), "--vae", str(vae),
            "--out", str(out), "--image-size", "32", "--shard-size", "1", "--batch-size", "1", "--cpu"]


@pytest.mark.slow
def test_latent_extraction_survives_kill_9_anywhere(extraction_inputs, tmp_path):
    from ancre_dit.latents.verify import verify_latent_dir

    rng = random.Random(SEED + 2)
    images, vae = extraction_inputs
    reference = tmp_path / "reference"
    _finish(_extract_cmd(images, vae, reference))
    out = tmp_path / "killed"
    tried = landed = 0
    for _ in range(KILLS):
        landed += _kill_after(_extract_cmd(images, vae, out), *_progress_kill(rng, _count(out, "shard-*.safetensors.sha256"), jitter=0.05))
        tried += 1
    _finish(_extract_cmd(images, vae, out))
    _same_tree(reference, out)  # shards, checksums, manifest and report, byte for byte; no leftover tmp file
    assert verify_latent_dir(out)[1] == []
    assert landed == tried, f"only {landed} of {tried} kills landed while the job ran"
    print(f"\nlatent extraction: {landed} kills landed of {tried} tried, all survived (every file bitwise identical)")
