"""The learning-rate schedules: their values at chosen steps (the formulas written again here, EDM2's
as its training loop computes it), the settings they refuse, and a resume that finds the same lr."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import accelerate_state, assert_same_weights, tiny_config

from ancre_dit.errors import UserError
from ancre_dit.training import train
from ancre_dit.training.lr_schedule import lr_at


def _train_section(tmp_path, *overrides: str):
    return tiny_config(tmp_path, *overrides).train


@pytest.mark.parametrize("schedule, n, expected", [
    ("constant", 5, 1e-3 * 5 / 10), ("constant", 10, 1e-3), ("constant", 110, 1e-3),
    ("cosine", 5, 1e-3 * 5 / 10), ("cosine", 10, 1e-3),
    ("cosine", 35, 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi / 4))),
    ("cosine", 60, (1e-3 + 1e-5) / 2), ("cosine", 110, 1e-5),
    ("linear", 5, 1e-3 * 5 / 10), ("linear", 10, 1e-3), ("linear", 35, 1e-3 - 0.25 * (1e-3 - 1e-5)),
    ("linear", 110, 1e-5),
])
def test_warmup_then_schedule_at_chosen_steps(tmp_path, schedule, n, expected):
    """lr 1e-3, 10 warm-up steps, 110 steps in all: the decay runs over the 100 after the warm-up."""
    floor = [] if schedule == "constant" else ["train.min_lr=1e-5"]
    t = _train_section(tmp_path, "train.lr=1e-3", "train.warmup_steps=10", "train.max_steps=110",
                       f"train.lr_schedule={schedule}", *floor)
    assert lr_at(t, n - 1) == pytest.approx(expected, rel=1e-12)


def _edm2_learning_rate(cur_nimg: int, batch_size: int, ref_lr: float, ref_batches: float, rampup_mimg: float):
    """EDM2's training/training_loop.py learning_rate_schedule, as it reads."""
    lr = ref_lr
    if ref_batches > 0:
        lr /= np.sqrt(max(cur_nimg / (ref_batches * batch_size), 1))
    if rampup_mimg > 0:
        lr *= min(cur_nimg / (rampup_mimg * 1e6), 1)
    return lr


def test_inverse_sqrt_is_edm2s_schedule(tmp_path):
    """Counted in optimizer steps: EDM2's images seen are steps x batch, its ramp-up steps x batch too."""
    batch, ref, warmup = 16, 100, 10
    t = _train_section(tmp_path, "train.lr=1e-2", "train.lr_schedule=inverse-sqrt", f"train.lr_decay_start={ref}",
                       f"train.warmup_steps={warmup}", "train.max_steps=1000", f"train.global_batch_size={batch}")
    for n in (1, 5, 10, 50, 100, 101, 400, 1000):
        want = _edm2_learning_rate(n * batch, batch, 1e-2, ref, warmup * batch / 1e6)
        assert lr_at(t, n - 1) == pytest.approx(want, rel=1e-12), n
    assert lr_at(t, 399) == pytest.approx(5e-3)
    floored = _train_section(tmp_path, "train.lr=1e-2", "train.lr_schedule=inverse-sqrt", "train.min_lr=6e-3",
                             f"train.lr_decay_start={ref}", "train.max_steps=1000")
    assert lr_at(floored, 399) == pytest.approx(6e-3)


@pytest.mark.parametrize("overrides, message", [
    (["train.lr_schedule=inverse-sqrt"], "train.lr_schedule=inverse-sqrt needs train.lr_decay_start"),
    (["train.lr_schedule=cosine", "train.lr_decay_start=10"], "train.lr_decay_start applies to "
                                                             "train.lr_schedule=inverse-sqrt, not cosine"),
    (["train.lr_schedule=cosine", "train.lr=1e-4", "train.min_lr=1e-3"], "train.min_lr=0.001 is above train.lr"),
    (["train.min_lr=1e-6"], "train.min_lr=1e-06 has no effect with train.lr_schedule=constant"),
    (["train.lr_schedule=linear", "train.warmup_steps=20", "train.max_steps=20"], "train.warmup_steps=20 leaves no"),
    (["train.lr_schedule=step"], "train.lr_schedule must be 'constant', 'cosine', 'linear' or 'inverse-sqrt'"),
])
def test_settings_a_schedule_cannot_use_are_refused(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tiny_config(tmp_path, *overrides)


@pytest.mark.slow
def test_a_resumed_cosine_run_finds_the_same_lr_and_weights(tmp_path):
    """The lr is a function of the step: a run resumed from its step-3 checkpoint logs the straight
    run's lr at every later step and ends with its weights, bit for bit."""
    settings = ["train.lr_schedule=cosine", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=2",
                "train.max_steps=6", "train.ckpt_every=3", "train.log_every=1"]
    with accelerate_state():
        train(tiny_config(tmp_path / "straight", *settings))
    with accelerate_state():
        train(tiny_config(tmp_path / "resumed", *settings), resume=str(tmp_path / "straight/checkpoints/0000003"))

    def logged_lr(run: str) -> dict[int, float]:
        rows = [json.loads(line) for line in (tmp_path / run / "logs/metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["lr"] for r in rows}

    straight, resumed = logged_lr("straight"), logged_lr("resumed")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == straight[s] for s in resumed)
    t = tiny_config(tmp_path / "x", *settings).train
    assert [straight[s] for s in range(1, 7)] == pytest.approx([lr_at(t, s - 1) for s in range(1, 7)], rel=1e-12)
    assert straight[6] == pytest.approx(1e-4) and straight[2] == pytest.approx(1e-3)
    assert_same_weights(tmp_path / "straight/checkpoints/0000006", tmp_path / "resumed/checkpoints/0000006")


def test_the_loss_figure_draws_the_logged_lr_beside_the_loss(tmp_path, monkeypatch):
    import ancre_dit.figures as figures
    from ancre_dit.training.run_log import plot_loss

    (tmp_path / "logs").mkdir()
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3 * min(1.0, s / 4)} for s in range(1, 9)]
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    monkeypatch.setattr(figures, "plot_panels", lambda panels, path, **kw: drawn.update(panels=panels, path=path))
    plot_loss(tmp_path)
    assert list(drawn["panels"]) == ["loss", "lr"] and drawn["path"] == tmp_path / "loss.png"
    steps, lr, _ = drawn["panels"]["lr"][""]
    assert steps.tolist() == list(range(1, 9)) and lr.tolist() == [r["lr"] for r in rows]
