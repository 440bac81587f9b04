"""Two CPU processes (gloo, torchrun + Accelerate's CPU mode) train like one process with the same
global batch: same logged loss, same gradient norm, same weights."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, free_port, run_forked_ranks, subprocess_env, train_tiny
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("_dist_train.py")

# learn_sigma and label dropout off so that the loss is a pure function of each sample's draws. The
# routing logits are held for these 2 steps: at adaLN-Zero's init every state is a multiple of h_0,
# so (through the final LayerNorm's scale invariance) their gradient is zero up to rounding, and Adam
# turns that rounding, which depends on the reduction order, into lr-sized steps of either sign.
SETTINGS = ["train.max_steps=2", "train.ckpt_every=2", "train.global_batch_size=16", "train.lr=1e-4",
            "model.learn_sigma=false", "model.class_dropout=0.0", "train.topology_warmup_steps=2"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), f"run_dir={two}", *SETTINGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((two / "checkpoints" / "0000002" / "trainer_state.json").read_text())
    assert state["num_processes"] == 2
    assert (two / "checkpoints" / "0000002" / "rng" / "rank1.pt").is_file()

    one = tmp_path / "one"
    run_forked_ranks(train_tiny, 1, f"run_dir={one}", *SETTINGS)

    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    w1 = load_file(str(one / "checkpoints" / "0000002" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "0000002" / "model.safetensors"))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-6, rtol=0), k
