"""Fault injection: kill -9 a tiny training run (at random moments and during checkpoint
writes), a sampling job and a latent extraction, several times each, rerunning the same command
after each kill; the final outputs must be bitwise identical to an uninterrupted run, and what a
kill leaves behind is never taken for complete (every checkpoint --resume auto could pick loads).

The kill moments come from a seeded RNG, so a failure can be replayed; each test reports
"kills survived / kills tried" on stdout (pytest -s) for BENCHMARKS.md. Each command runs as the
shell runs it (its main, its argv) in a process forked from the test (helpers.fork_command): the
kills land in the command's work, not in an interpreter importing its stack.
"""
from __future__ import annotations

import filecmp
import json
import multiprocessing
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

from helpers import ROOT, TINY_TRAIN, accelerate_state, fork_command, run_command, tiny_overrides

from ancre_dit.checkpoint import load_trained_model  # noqa: E402
from ancre_dit.training.checkpointing import checkpoint_problem, list_checkpoints  # noqa: E402

KILLS = 3          # kills per job at random moments (plus, for training, 2 timed to land in a checkpoint write)
SEED = 14


def _start(cmd: list[str], stderr: Path | None = None) -> multiprocessing.Process:
    """cmd: the script, then its arguments."""
    return fork_command(Path(cmd[0]), *cmd[1:], stderr=stderr)


def _finish(cmd: list[str]) -> None:
    run_command(Path(cmd[0]), *cmd[1:])


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
        while proc.is_alive() and not until():
            time.sleep(0.005)
        time.sleep(extra)
        if not proc.is_alive():
            assert proc.exitcode == 0, f"the job failed with exit code {proc.exitcode} (its stderr is above)"
            return False
        proc.kill()
        proc.join(timeout=60)
        return True
    finally:
        if proc.is_alive():
            proc.kill()


def _same_tree(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> None:
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and not p.name.startswith(ignore))
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and not p.name.startswith(ignore))
    assert files_a == files_b
    match, mismatch, errors = filecmp.cmpfiles(a, b, files_a, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


# -- training ----------------------------------------------------------------------------------
TRAIN_STEPS = 32


def _train_cmd(run: Path, *overrides: str) -> list[str]:
    return [str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
            *tiny_overrides(f"run_dir={run}", f"train.max_steps={TRAIN_STEPS}", "train.ckpt_every=2", "train.keep_last=2",
                            *overrides), "--resume", "auto"]


def _assert_every_checkpoint_sound(run: Path) -> None:
    """What --resume auto may pick after a kill: complete folders only, each one loading back."""
    for step, folder in list_checkpoints(run):
        assert checkpoint_problem(folder) is None, folder
        model, spec = load_trained_model(folder)
        assert spec["step"] == step


def _final_state(run: Path) -> dict[str, bytes]:
    last = run / "checkpoints" / f"{TRAIN_STEPS:07d}"
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
    # being written (its .tmp- folder exists). A tiny step takes tens of milliseconds: the jitter
    # stays within a few of them, so that every kill lands before the job's last step.
    for k in range(KILLS + 2):
        until, extra = (_progress_kill(rng, steps_done, jitter=0.1) if k < KILLS
                        else (saving, rng.uniform(0.0, 0.05)))
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
    return [str(ROOT / "sample.py"), "--ckpt", str(ckpt), "--num-samples", "12", "--batch-size", "2",
            "--sampler", "ddpm", "--steps", "20", "--out", str(out), "--cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sampling-run")
    _finish([str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
             *tiny_overrides(f"run_dir={run}", "train.max_steps=2", "train.ckpt_every=2")])
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
    return [str(ROOT / "scripts" / "extract_latents.py"), "--data-path", str(images), "--vae", str(vae),
            "--out", str(out), "--image-size", "32", "--shard-size", "1", "--batch-size", "1", "--cpu"]


@pytest.mark.slow
def test_latent_extraction_survives_kill_9_anywhere(extraction_inputs, tmp_path):
    from ancre_dit.latents.shards import verify_latent_dir

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


# -- two trainings on one run folder -------------------------------------------------------------
@pytest.mark.slow
def test_a_second_training_on_a_run_folder_is_refused_and_a_kill_frees_it(tmp_path):
    run = tmp_path / "run"
    long_run = _train_cmd(run, "train.max_steps=100000", "train.ckpt_every=100000")[:-2]
    metrics = run / "logs" / "metrics.jsonl"
    first = _start(long_run)
    try:
        while first.is_alive() and not (metrics.is_file() and metrics.read_text()):
            time.sleep(0.05)
        assert first.is_alive(), f"the first training ended with exit code {first.exitcode} (its stderr is above)"
        second = _start(_train_cmd(run), stderr=tmp_path / "second.err")
        second.join(timeout=600)
        err = (tmp_path / "second.err").read_text()
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert second.exitcode == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert f"in use by another training (pid {first.pid} on " in errors[0]
        assert not (run / "checkpoints").exists()  # the refused run wrote nothing
    finally:
        first.kill()
        first.join(timeout=60)
    # kill -9 leaves no claim behind; the next start also removes the temporary folder of a dead save.
    (run / "checkpoints" / ".tmp-0000099" / "accelerate").mkdir(parents=True)
    _finish(_train_cmd(run, "train.max_steps=2")[:-2])
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["0000002"]


# -- a full disk, a read-only file system (small tmpfs mounts) -----------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """mount(size=4 MiB, ro=False) -> a tmpfs folder, unmounted afterwards; skipped where this
    machine does not let the tests mount one (not root, or no tmpfs in the container)."""
    mounted = []

    def mount(size: str = "4m", ro: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if ro else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'})")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _cli(main, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    from ancre_dit.cli import run_cli

    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with accelerate_state(), pytest.raises(SystemExit) as exit_info:
        run_cli(main)
    return exit_info.value.code, capsys.readouterr().err


def _one_error_line(code: int, err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and "Logging error" not in err, err
    return errors[0]


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_one_line_and_loses_nothing(small_fs, monkeypatch, capsys):
    import runpy
    import shutil

    from helpers import one_torch_thread
    from ancre_dit.training import load_config
    from ancre_dit.training.run_lock import release_run_dir

    train_main = runpy.run_path(str(ROOT / "train.py"), run_name="faults")["main"]
    disk = small_fs("4m")
    run = disk / "run"
    argv = ["--config", str(ROOT / "configs" / "digits-ancre.yaml"),
            *tiny_overrides(f"run_dir={run}", "train.ckpt_every=2", "train.keep_last=0"), "--resume", "auto"]
    try:
        with one_torch_thread():
            assert _cli(train_main, [*argv, "train.max_steps=2"], monkeypatch, capsys)[0] == 0
            step2 = run / "checkpoints" / "0000002"
            before = {p: p.read_bytes() for p in step2.rglob("*") if p.is_file()}
            size = sum(len(b) for b in before.values())
            (disk / "ballast").write_bytes(b"\0" * (shutil.disk_usage(disk).free - size // 2))
            for _ in range(2):  # the disk still full at the second try (a resume)
                line = _one_error_line(*_cli(train_main, [*argv, "train.max_steps=4"], monkeypatch, capsys))
                assert "no space left on the device while writing the checkpoint" in line
                assert str(run / "checkpoints" / ".tmp-0000004") in line and "MiB free" in line
                assert [p.name for p in (run / "checkpoints").iterdir()] == ["0000002"]  # temporary folder removed
                assert {p: p.read_bytes() for p in step2.rglob("*") if p.is_file()} == before
                assert load_config(run / "config.yaml").train.max_steps == 4  # written whole (atomically)
            (disk / "ballast").unlink()
            assert _cli(train_main, [*argv, "train.max_steps=4"], monkeypatch, capsys)[0] == 0
            assert checkpoint_problem(run / "checkpoints" / "0000004") is None
    finally:
        release_run_dir(run)  # the claim's open file would keep the mount busy


@pytest.mark.slow
def test_read_only_outputs_are_one_line(small_fs, checkpoint, monkeypatch, capsys):
    import runpy

    read_only = small_fs("1m", ro=True)
    train_main = runpy.run_path(str(ROOT / "train.py"), run_name="faults")["main"]
    sample_main = runpy.run_path(str(ROOT / "sample.py"), run_name="faults")["main"]
    line = _one_error_line(*_cli(train_main, ["--config", str(ROOT / "configs" / "digits-ancre.yaml"), *TINY_TRAIN,
                                              f"run_dir={read_only / 'run'}"], monkeypatch, capsys))
    assert "cannot be created (Read-only file system)" in line
    line = _one_error_line(*_cli(lambda: sample_main(["--ckpt", str(checkpoint), "--out", str(read_only / "s.npz"),
                                                      "--cpu"]), [], monkeypatch, capsys))
    assert "is not writable" in line and "s.npz" in line
