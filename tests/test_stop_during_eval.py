"""A stop signal (SIGTERM from a cluster's preemption, Ctrl-C) that arrives during an in-training
evaluation abandons it after the current sampling part, so the run checkpoints within the grace
period; the resumed run evaluates that step first and loses nothing."""
from __future__ import annotations

import os
import signal

import pytest

from ancre_dit.evaluation.evaluator import Evaluator
from ancre_dit.training.run_evaluation import read_evals
from ancre_dit.training import train
from ancre_dit.training.checkpointing import list_checkpoints

from helpers import accelerate_state, tiny_config

EVAL = ["train.eval_every=4", "train.max_steps=8", "train.ckpt_every=100", "eval.num_samples=40",
        "eval.batch_size=10", "eval.metrics=[digits]", "eval.steps=2", "eval.heldout_max=16"]


def run(run_dir, resume=None):
    with accelerate_state():
        return train(tiny_config(run_dir, *EVAL), resume=resume)


@pytest.mark.slow
def test_sigterm_during_an_evaluation_checkpoints_at_once_and_the_resume_redoes_it(tmp_path, monkeypatch):
    features = Evaluator._features
    parts = []

    def preempted(self, images):  # the cluster's SIGTERM arrives while the first part is scored
        parts.append(len(images))
        if len(parts) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return features(self, images)

    monkeypatch.setattr(Evaluator, "_features", preempted)
    first = run(tmp_path)
    assert first["stopped"] and first["step"] == 4
    assert len(parts) == 1  # abandoned after one of its four sampling parts, not at the end
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4]
    assert [e["step"] for e in read_evals(tmp_path)] == []  # nothing half-recorded

    monkeypatch.setattr(Evaluator, "_features", features)
    second = run(tmp_path, resume="auto")
    assert not second["stopped"] and second["step"] == 8
    entries = read_evals(tmp_path)
    assert [e["step"] for e in entries] == [4, 8]
    assert all("digits_acc/cfg1" in e["metrics"] for e in entries)
