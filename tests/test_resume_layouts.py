"""One checkpoint format whatever wraps the model: a run resumes across 1 <-> 2 processes, with
train.compile and train.grad_checkpointing switched, and from its weights files alone.

What stays bitwise: the same layout resumed (tests/test_training.py, tests/test_preemption.py) and
gradient checkpointing switched (it recomputes the same forward). Another process count changes
the order of the gradient all-reduce and torch.compile fuses kernels differently, so those resumes
agree with the straight run to rounding (1e-4 relative, 1e-5 absolute), not bitwise. The two-process
legs are gloo ranks forked from the test (helpers.run_forked_ranks): the subject is the checkpoint,
not the launcher."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from helpers import accelerate_state, assert_same_weights, deterministic_draws, run_forked_ranks, tiny_config, train_tiny
from safetensors.torch import load_file

from ancre_dit.training import Trainer

SETTINGS = ["train.global_batch_size=16", "train.lr=1e-3", "model.learn_sigma=false", "model.class_dropout=0.0",
            "train.ckpt_every=2"]
# Across process counts the routing logits are held (see tests/test_distributed.py: their gradient at
# init is rounding noise that Adam amplifies, and the reduction order changes that noise).
HOLD_ROUTING = "train.topology_warmup_steps=6"


def _one_process(run: Path, steps: int, *extra: str, resume: str | None = None) -> None:
    with accelerate_state():
        Trainer(tiny_config(run, *SETTINGS, f"train.max_steps={steps}", *extra), resume=resume).run()


def _two_processes(run: Path, steps: int, *extra: str, resume: str | None = None) -> None:
    run_forked_ranks(functools.partial(train_tiny, resume=resume), 2, f"run_dir={run}", *SETTINGS,
                     f"train.max_steps={steps}", *extra)


def _assert_close(a: Path, b: Path) -> None:
    for name in ("model", "ema"):
        wa, wb = load_file(str(a / f"{name}.safetensors")), load_file(str(b / f"{name}.safetensors"))
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-5), (name, k, (wa[k] - wb[k]).abs().max())


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"{step:07d}"


@pytest.mark.slow
def test_resume_across_one_and_two_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "draw_timesteps_and_noise", deterministic_draws)
    straight = tmp_path / "straight"
    _one_process(straight, 6, HOLD_ROUTING)
    # 2 processes -> 1 process
    down = tmp_path / "down"
    _two_processes(down, 2, HOLD_ROUTING)
    _one_process(down, 6, HOLD_ROUTING, resume="auto")
    _assert_close(_ckpt(straight, 6), _ckpt(down, 6))
    # 1 process -> 2 processes
    up = tmp_path / "up"
    _one_process(up, 2, HOLD_ROUTING)
    _two_processes(up, 6, HOLD_ROUTING, resume="auto")
    _assert_close(_ckpt(straight, 6), _ckpt(up, 6))
    assert json.loads((_ckpt(up, 6) / "trainer_state.json").read_text())["num_processes"] == 2


@pytest.mark.slow
def test_resume_with_compile_and_grad_checkpointing_switched(tmp_path, monkeypatch):
    # The wrapper (and its `_orig_mod.` keys) is what a compiled run differs by; the backend that
    # makes kernels does not matter to the checkpoint format, so the test skips inductor's codegen.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    straight = tmp_path / "straight"
    _one_process(straight, 6)
    switched = tmp_path / "switched"
    _one_process(switched, 2)
    _one_process(switched, 4, "train.compile=true", resume="auto")
    _one_process(switched, 6, "train.grad_checkpointing=true", resume="auto")
    _assert_close(_ckpt(straight, 6), _ckpt(switched, 6))
    # Gradient checkpointing alone keeps the resume bitwise.
    ckpt = tmp_path / "ckpt"
    _one_process(ckpt, 2)
    _one_process(ckpt, 6, "train.grad_checkpointing=true", resume="auto")
    assert_same_weights(_ckpt(straight, 6), _ckpt(ckpt, 6))
