"""The non-finite guard: a NaN / inf loss never reaches the weights, the optimizer, the EMA
or a checkpoint; `skip` drops up to N updates in a row and then stops, `stop` stops at once, and
the run says which step, which terms and which checkpoint is the last good one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, subprocess_env, tiny_config, tiny_overrides, write_latent_dir

import ancre_dit.training.trainer as trainer_module  # noqa: E402
from ancre_dit.training import train  # noqa: E402
from ancre_dit.training.checkpointing import list_checkpoints  # noqa: E402
from ancre_dit.training.guards import NonFiniteStop  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _inject_inf_at(monkeypatch, steps: set[int]) -> None:
    """Test hook: the batch of each listed optimizer step (1-based) gets an inf pixel."""
    real = trainer_module.prepare_batch
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        x, y = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] in steps:
            x = x.clone()
            x[0, 0, 0, 0] = float("inf")
        return x, y

    monkeypatch.setattr(trainer_module, "prepare_batch", poisoned)


def _weights(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(str(folder / f"{name}.safetensors")) for name in ("model", "ema")}


def _all_finite(folder: Path) -> bool:
    return all(torch.isfinite(v).all() for state in _weights(folder).values() for v in state.values())


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def _optimizer_state(folder: Path) -> dict:
    return torch.load(folder / "accelerate" / "optimizer.bin", weights_only=False)["state"]


@pytest.mark.slow
def test_skipped_steps_leave_weights_optimizer_and_ema_untouched(tmp_path, monkeypatch):
    _inject_inf_at(monkeypatch, {3, 4})
    run = tmp_path / "run"
    out = train(tiny_config(run, "train.max_steps=6", "train.ckpt_every=1", "train.nonfinite_max_skips=2"))
    assert out["step"] == 6
    ck = dict(list_checkpoints(run))
    assert all(_all_finite(folder) for folder in ck.values())
    # Steps 3 and 4 were skipped: weights, EMA and AdamW moments are those of step 2, bitwise.
    assert _same(_weights(ck[2]), _weights(ck[4]))
    o2, o4 = _optimizer_state(ck[2]), _optimizer_state(ck[4])
    assert all(torch.equal(o2[p]["exp_avg"], o4[p]["exp_avg"]) for p in o2)
    assert not _same(_weights(ck[4]), _weights(ck[5]))  # training goes on afterwards
    log = (run / "log.txt").read_text()
    assert "step 3: non-finite loss or gradient (loss nan" in log or "step 3: non-finite loss or gradient (loss inf" in log
    assert "update skipped (2 in a row, stop after 2)" in log
    assert f"last good checkpoint: {ck[2]}" in log and f"last good checkpoint: {ck[3]}" in log
    skipped = [row["skipped"] for row in map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines())]
    assert skipped == [0, 0, 1, 1, 0, 0]


def test_too_many_in_a_row_stops_without_saving(tmp_path, monkeypatch):
    _inject_inf_at(monkeypatch, set(range(4, 100)))
    run = tmp_path / "run"
    with pytest.raises(NonFiniteStop) as err:
        train(tiny_config(run, "train.max_steps=20", "train.ckpt_every=3", "train.nonfinite_max_skips=2"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("training stopped at step 6: non-finite loss or gradient (loss ")
    assert "mse " in message and "grad_norm " in message
    assert "3 non-finite steps in a row, more than train.nonfinite_max_skips=2" in message
    assert f"last good checkpoint: {run / 'checkpoints' / '0000003'}" in message
    # Nothing saved on the way out: the newest checkpoint is the good one of step 3.
    assert [s for s, _ in list_checkpoints(run)] == [3]
    assert _all_finite(run / "checkpoints" / "0000003")
    assert "training stopped at step 6" in (run / "log.txt").read_text()


def test_a_run_that_skips_most_of_its_steps_stops(tmp_path, monkeypatch):
    _inject_inf_at(monkeypatch, {k for k in range(1, 100) if k % 4})  # 3 of every 4 steps
    run = tmp_path / "run"
    with pytest.raises(NonFiniteStop) as err:
        train(tiny_config(run, "train.max_steps=40", "train.nonfinite_max_skips=50"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("training stopped at step 10: ")
    assert "8 of the 10 steps so far were non-finite and skipped" in message
    assert "its input batch itself is non-finite" in message  # the poisoned batches, after reading


def _latents_with_an_inf_sample(root: Path) -> Path:
    """Two shards of 4x4x4 latents; image 5's mean is +inf (a corrupted sample in real data)."""
    g = torch.Generator().manual_seed(0)
    shards = []
    for k in range(2):
        mean = torch.randn(12, 2, 4, 4, 4, generator=g).half()
        if k == 0:
            mean[5] = float("inf")
        shards.append({"mean": mean, "std": (0.1 * torch.rand(12, 2, 4, 4, 4, generator=g)).half(),
                       "label": torch.arange(12) % 3, "index": torch.arange(12) + 12 * k})
    return write_latent_dir(root, shards, num_classes=3, image_size=32)


@pytest.mark.slow
def test_an_inf_data_sample_is_skipped_or_stops_the_command(tmp_path):
    latents = _latents_with_an_inf_sample(tmp_path / "latents")
    common = ["data.kind=latents", f"data.path={latents}", "data.image_size=32", "train.global_batch_size=8",
              "train.ckpt_every=3"]
    # skip: the one poisoned batch per epoch (3 batches of 8) is dropped, the run finishes finite.
    run = tmp_path / "skip"
    out = train(tiny_config(run, "train.max_steps=9", *common))
    assert out["step"] == 9 and _all_finite(run / "checkpoints" / "0000009")
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["skipped"] for r in rows) == 3  # once per epoch
    # The warning names the data: the shard file and row of the poisoned sample.
    assert "its input batch itself is non-finite (non-finite data: shard-00000.safetensors row 5)" in (run / "log.txt").read_text()
    assert all(r["loss"] == r["loss"] for r in rows if not r["skipped"])  # the others are finite
    # stop, through the real command line: exit 2, the error line names the step and the policy.
    run = tmp_path / "stop"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
                           *tiny_overrides(f"run_dir={run}", "train.max_steps=9", "train.nonfinite=stop", *common)],
                          capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite loss or gradient" in errors[0] and "train.nonfinite=stop" in errors[0]
    first_bad = int(errors[0].split("step ")[1].split(":")[0])
    assert [s for s, _ in list_checkpoints(run)] == [s for s in (3, 6) if s < first_bad]
