"""`python -m benchmarks.bench_quickstart` times the quickstart's three steps and reads the digits accuracy back."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_times_train_sample_evaluate_and_reports_accuracy(tmp_path):
    run = tmp_path / "qs"
    cmd = [sys.executable, "-m", "benchmarks.bench_quickstart", "--run-dir", str(run), "--num-samples", "20",
           "--sample-batch", "20", "--sampler", "euler", "--steps", "3", "--",
           "train.max_steps=3", "train.ckpt_every=3", "train.sample_every=0", "train.eval_every=0", "model.depth=2",
           "log.tensorboard=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "bench_quickstart.json").read_text())
    assert 0.0 <= report["accuracy"] <= 1.0 and report["num_samples"] == 20
    for step in ("train", "sample", "evaluate"):
        assert report["seconds"][step]["wall"] > 0 and report["seconds"][step]["cpu"] > 0
    assert (run / "checkpoints" / "0000003").is_dir() and (run / "samples.npz").is_file()
