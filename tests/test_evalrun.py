"""Evaluation during training: entries match `evaluate.py --run` on the same checkpoint,
runs with evaluation on train the same weights and resume bitwise, 1 and 2 processes give the same
numbers, the digits metric separates real digits from noise, and compare_runs' steps to target and
speedups are exact on hand-made metric files."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from helpers import ROOT, accelerate_state, assert_same_weights, run_forked_ranks, script_main, subprocess_env, tiny_config

from ancre_dit.errors import UserError
from ancre_dit.studies.comparison import SeedSpeedup, interval_curve, steps_to_target, summarize, write_report
from ancre_dit.studies.run_curves import group_runs, load_run
from ancre_dit.training.run_evaluation import read_evals
from ancre_dit.training import train
from ancre_dit.training.config import load_config
from ancre_dit.training.run_evaluation import evaluate_run

# Several parts per evaluation (20 samples in parts of 8), two cfg scales, label dropout and learned
# sigma on, so every random stream of training is in play.
EVAL = ["train.eval_every=1", "eval.num_samples=20", "eval.batch_size=8", "eval.steps=4", "eval.sampler=ddpm",
        "eval.cfg_scales=[1.0,2.0]", "eval.heldout_draws=1", "eval.heldout_max=24", "model.class_dropout=0.1",
        "model.learn_sigma=true"]


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _by_step(entries: list[dict]) -> dict[int, dict]:
    return {e["step"]: e["metrics"] for e in entries}


@pytest.mark.slow
def test_eval_entries_match_evaluate_run_and_leave_training_unchanged(tmp_path):
    ckpt = ["train.ckpt_every=2"]
    with accelerate_state():
        train(tiny_config(tmp_path / "on", "train.max_steps=4", *ckpt, *EVAL, "log.figures=true"))
    entries = read_evals(tmp_path / "on")
    assert [e["step"] for e in entries] == [1, 2, 3, 4]
    first = entries[0]["metrics"]
    assert {"heldout_loss", "heldout_loss_raw", "digits_acc/cfg1", "digits_fd/cfg2"} <= set(first)
    assert all(np.isfinite(v) for e in entries for v in e["metrics"].values())
    assert entries[0]["images_seen"] == 16 and entries[0]["seconds"] > 0 and entries[0]["source"] == "train"
    assert entries[-1]["metrics"]["heldout_loss_raw"] < first["heldout_loss_raw"]  # the raw model learns
    assert (tmp_path / "on" / "quality.png").is_file() and (tmp_path / "on" / "loss.png").is_file()

    # The same run with evaluation off trains the same weights (the training streams are untouched).
    with accelerate_state():
        train(tiny_config(tmp_path / "off", "train.max_steps=4", *ckpt, *EVAL[1:], "train.eval_every=0"))
    assert_same_weights(tmp_path / "on" / "checkpoints" / "0000004", tmp_path / "off" / "checkpoints" / "0000004")
    assert not (tmp_path / "off" / "logs" / "evals.jsonl").exists()

    # Resume with evaluation on: 2 steps, then 2 more from the checkpoint -> same weights and entries.
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=2", *ckpt, *EVAL))
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=4", *ckpt, *EVAL), resume="auto")
    assert_same_weights(tmp_path / "on" / "checkpoints" / "0000004", tmp_path / "split" / "checkpoints" / "0000004")
    assert _by_step(read_evals(tmp_path / "split")) == _by_step(entries)

    # evaluate.py --run on the finished run's checkpoints gives the numbers training wrote.
    shutil.move(tmp_path / "on" / "logs" / "evals.jsonl", tmp_path / "training_evals.jsonl")
    new = evaluate_run(tmp_path / "on", log=lambda *a: None)
    assert [e["step"] for e in new] == [2, 4] and all(e["source"] == "evaluate.py" for e in new)
    during = _by_step(entries)
    for e in new:
        assert e["metrics"] == during[e["step"]], e["step"]
    assert evaluate_run(tmp_path / "on", log=lambda *a: None) == []  # resumable: nothing left to do
    # other settings are a different evaluation, done again
    again = evaluate_run(tmp_path / "on", [4], ["eval.num_samples=10"], log=lambda *a: None)
    assert [e["step"] for e in again] == [4] and again[0]["settings"]["num_samples"] == 10


@pytest.mark.slow
def test_one_and_two_process_evaluations_give_the_same_numbers(tmp_path):
    with accelerate_state():
        train(tiny_config(tmp_path / "one", "train.max_steps=2", "train.ckpt_every=2", *EVAL[1:]))
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    # `evaluate.py --run` as one process and as two gloo ranks, forked from this one
    run_forked_ranks(script_main(ROOT / "evaluate.py", "--run", str(tmp_path / "one")), 1)
    run_forked_ranks(script_main(ROOT / "evaluate.py", "--run", str(tmp_path / "two")), 2)
    e1, e2 = read_evals(tmp_path / "one"), read_evals(tmp_path / "two")
    assert len(e1) == len(e2) == 1  # one entry: the second process appended nothing
    assert e1[0]["metrics"] == e2[0]["metrics"]
    assert "digits_acc/cfg2" in e1[0]["metrics"]


@pytest.mark.slow
def test_digits_metric_separates_real_digits_from_noise(tmp_path):
    from ancre_dit.data.adm_npz import to_uint8
    from ancre_dit.data.digits import DigitsDataset
    from ancre_dit.evaluation.digits_metric import _classifier, classify, digits_metric, digits_reference_scores

    ref = digits_reference_scores()
    assert ref["real_heldout_acc"] > 0.9
    held = DigitsDataset("heldout")
    images = to_uint8(held.images).transpose(0, 2, 3, 1)  # (N, 8, 8, 1) uint8, as sampling writes them
    real = digits_metric(*classify(images), held.labels.numpy())
    noise = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    fake = digits_metric(*classify(noise), held.labels.numpy())
    assert real["digits_acc"] == pytest.approx(ref["real_heldout_acc"])
    assert real["digits_fd"] == pytest.approx(ref["real_heldout_fd"], rel=0.01)  # uint8 rounding only
    assert fake["digits_acc"] < 0.3 and fake["digits_fd"] > 10 * real["digits_fd"]
    # deterministic fit: a second classifier is the same bit for bit
    first = _classifier()
    _classifier.cache_clear()
    second = _classifier()
    assert first is not second and np.array_equal(first.support_, second.support_)
    assert np.array_equal(first.dual_coef_, second.dual_coef_) and np.array_equal(first.intercept_, second.intercept_)


def test_heldout_set_is_fixed_and_spreads_times():
    from ancre_dit.data.digits import DigitsDataset
    from ancre_dit.evaluation.evaluator import build_heldout_set

    from ancre_dit.diffusion import build_objective

    kwargs = dict(max_examples=50, draws=2, seed=3, objective=build_objective({"objective": "ddpm"}))
    a = build_heldout_set(DigitsDataset("heldout"), "digits", **kwargs)
    b = build_heldout_set(DigitsDataset("heldout"), "digits", **kwargs)
    assert len(a) == 100 and a.num_examples == 50
    assert torch.equal(a.noise, b.noise) and torch.equal(a.t, b.t) and torch.equal(a.x, b.x)
    assert sorted(a.t.tolist()) == [int((i + 0.5) * 10) for i in range(100)]  # one per stratum of 10 steps


@pytest.mark.parametrize("override, message", [
    ("eval.metrics=[fidd]", "unknown metric 'fidd'"),
    ("eval.cfg_scales=[-1.0]", "eval.cfg_scales -1.0 is negative"),
    ("eval.val_path=/nowhere", "apply to data.kind=latents only"),
    ("train.eval_every=-1", "train.eval_every must be greater than or equal to 0"),
    ("eval.num_samples=0", "eval.num_samples must be greater than or equal to 1"),
])
def test_bad_eval_settings_one_line(override, message, tmp_path):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        tiny_config(tmp_path, override)


def test_evaluate_run_errors(tmp_path):
    with pytest.raises(UserError, match="config.yaml missing"):
        evaluate_run(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"kind": "digits", "image_size": 8}}))
    with pytest.raises(UserError, match="eval.\\* overrides only"):
        evaluate_run(tmp_path, overrides=["train.lr=1"])
    with pytest.raises(UserError, match="no complete checkpoint"):
        evaluate_run(tmp_path)
    load_config(tmp_path / "config.yaml")  # the file itself is fine


# -- compare_runs ----------------------------------------------------------------------------------
def _fake_run(root: Path, name: str, losses: dict[int, float], evals: dict[int, dict[str, float]],
              seed: int = 0, topology: str = "ancre", batch: int = 10) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "model": {"topology": topology},
                                                     "train": {"seed": seed, "global_batch_size": batch}}))
    (run / "logs" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": v, "train_seconds": 2.0 * s}) + "\n" for s, v in losses.items()))
    (run / "logs" / "evals.jsonl").write_text("".join(
        json.dumps({"step": s, "metrics": m, "settings": {"k": 1}, "images_seen": s * batch}) + "\n"
        for s, m in evals.items()))
    return run


def test_steps_to_target_and_speedup_are_exact(tmp_path):
    assert steps_to_target(np.array([1, 2, 3]), np.array([5.0, 3.0, 1.0]), 3.0, True) == 2
    assert steps_to_target(np.array([1, 2, 3]), np.array([0.1, 0.5, 0.9]), 0.5, False) == 2
    assert steps_to_target(np.array([1, 2, 3]), np.array([5.0, 4.0, 3.5]), 3.0, True) is None

    base = _fake_run(tmp_path, "base", {100: 1.0, 200: 0.8, 300: 0.6, 400: 0.5},
                     {100: {"heldout_loss": 0.9, "digits_acc/cfg2": 0.2}, 200: {"heldout_loss": 0.7, "digits_acc/cfg2": 0.5},
                      300: {"heldout_loss": 0.6, "digits_acc/cfg2": 0.7}, 400: {"heldout_loss": 0.55, "digits_acc/cfg2": 0.8}},
                     topology="cascaded")
    fast = _fake_run(tmp_path, "fast", {100: 0.7, 200: 0.5, 300: 0.4, 400: 0.3},
                     {100: {"heldout_loss": 0.55, "digits_acc/cfg2": 0.6}, 200: {"heldout_loss": 0.5, "digits_acc/cfg2": 0.85},
                      300: {"heldout_loss": 0.45, "digits_acc/cfg2": 0.9}, 400: {"heldout_loss": 0.4, "digits_acc/cfg2": 0.9}})
    never = _fake_run(tmp_path, "never", {100: 1.2, 200: 1.1, 300: 1.0, 400: 0.9},
                      {100: {"heldout_loss": 1.0, "digits_acc/cfg2": 0.1}, 200: {"heldout_loss": 0.9, "digits_acc/cfg2": 0.2},
                       300: {"heldout_loss": 0.8, "digits_acc/cfg2": 0.3}, 400: {"heldout_loss": 0.7, "digits_acc/cfg2": 0.4}},
                      topology="hc")
    summary = write_report([base, fast, never], tmp_path / "report")
    rows = {m: {r.group: r for r in info["rows"]} for m, info in summary.items()}
    # one seed each (0): the target is the baseline's final value for that seed
    fast_loss = rows["train_loss"]["fast"].speedup.seeds[0]
    assert fast_loss.target == 0.5 and rows["digits_acc/cfg2"]["fast"].speedup.seeds[0].target == 0.8
    assert (fast_loss.baseline_steps, fast_loss.arm_steps) == (400, 200)
    assert rows["train_loss"]["fast"].speedup.geomean == 2.0
    assert rows["train_loss"]["base"].speedup is None and rows["train_loss"]["base"].verdict == "baseline"
    heldout = rows["heldout_loss"]["fast"].speedup
    assert heldout.seeds[0].arm_steps == 100 and heldout.geomean == 4.0
    assert rows["digits_acc/cfg2"]["fast"].speedup.seeds[0].arm_steps == 200  # higher is better: first >= 0.8
    assert rows["digits_acc/cfg2"]["fast"].speedup.geomean == 2.0
    for metric in ("train_loss", "heldout_loss", "digits_acc/cfg2"):
        never_seed = rows[metric]["never"].speedup.seeds[0]
        assert never_seed.arm_steps is None and never_seed.speedup is None and rows[metric]["never"].speedup.geomean is None
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| never | 400 | 0.9 | not reached by 400 | - |" in report
    assert "| fast | 400 | 0.3 | 200 | 2.00x |" in report
    for axis in ("step", "images", "seconds"):
        assert (tmp_path / "report" / f"curves_{axis}.png").stat().st_size > 1000
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["train_loss"]["rows"][1]["speedup"]["geomean"] == 2.0


def test_seed_groups_aggregate_mean_and_std(tmp_path):
    a0 = _fake_run(tmp_path, "ancre-s0", {10: 1.0, 20: 0.6}, {10: {"heldout_loss": 1.0}, 20: {"heldout_loss": 0.5}}, seed=0)
    a1 = _fake_run(tmp_path, "ancre-s1", {10: 0.8, 20: 0.4}, {10: {"heldout_loss": 0.8}, 20: {"heldout_loss": 0.3}}, seed=1)
    c0 = _fake_run(tmp_path, "casc-s0", {10: 1.0, 20: 0.8, 30: 0.5}, {10: {"heldout_loss": 1.0}}, seed=0,
                   topology="cascaded")
    runs = [load_run(p) for p in (c0, a0, a1)]
    by_config = group_runs(runs)  # same config up to the seed
    assert [len(g.runs) for g in by_config] == [1, 2]
    by_pattern = group_runs(runs, ["ancre-*"])
    assert [g.label for g in by_pattern] == ["casc-s0", "ancre-*"]
    x, mean, half = interval_curve(by_config[1], "train_loss")
    assert x.tolist() == [10, 20] and mean.tolist() == pytest.approx([0.9, 0.5])
    t1 = 12.706204736  # t(0.975, 1): two runs
    assert half.tolist() == pytest.approx([t1 * np.std([1.0, 0.8], ddof=1) / np.sqrt(2),
                                           t1 * np.std([0.6, 0.4], ddof=1) / np.sqrt(2)], rel=1e-6)
    x_seconds = interval_curve(by_config[1], "train_loss", "seconds")[0]
    assert x_seconds.tolist() == [20.0, 40.0]
    summary = summarize(by_config)
    # Paired by seed: only seed 0 has a cascaded run; its target is that run's final loss 0.5, which
    # ancre-s0 never reaches (0.6 at its last step 20), although the mean of ancre's two seeds does
    # at step 20: censored, the speedup is below 30 / 20.
    rows = {r.group: r for r in summary["train_loss"]["rows"]}
    assert rows["ancre-s* (2 runs)"].speedup.seeds == [SeedSpeedup(0, 0.5, 30, None, 20, None, 1.5)]
    assert rows["ancre-s* (2 runs)"].verdict == "slower: the baseline's final value not reached by 1 of 1 seeds"
    assert rows["ancre-s* (2 runs)"].final.std == pytest.approx(np.std([0.6, 0.4], ddof=1))


@pytest.mark.slow
def test_compare_runs_command(tmp_path):
    run = _fake_run(tmp_path, "r", {1: 1.0, 2: 0.5}, {2: {"heldout_loss": 0.4}})
    env = subprocess_env()
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(run), "--out",
                         str(tmp_path / "out"), "--target", "heldout_loss=0.45"], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "target 0.45" in (tmp_path / "out" / "report.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(tmp_path / "missing"),
                          "--out", str(tmp_path / "o2")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "error: run directory" in bad.stderr


@pytest.mark.slow
def test_inception_metrics_during_training_equal_the_offline_pipeline(tmp_path):
    """FID / IS / precision / recall in training (features per part, gathered, scored) give the numbers
    of sample.py + the standalone evaluator on the same checkpoint, seed and sampler. Random Inception
    weights (written here) keep it offline: the values mean nothing, their equality does."""
    from ancre_dit.data.adm_npz import save_adm_npz
    from ancre_dit.data.adm_npz import to_uint8
    from ancre_dit.data.digits import DigitsDataset
    from ancre_dit.evaluation import WEIGHTS_NAME, evaluate, write_random_inception_weights
    from helpers import load_script

    weights = write_random_inception_weights(tmp_path / WEIGHTS_NAME, seed=0)
    held = DigitsDataset("heldout")
    ref = save_adm_npz(tmp_path / "ref.npz", to_uint8(held.images[:10]).transpose(0, 2, 3, 1), held.labels[:10].numpy())
    metrics = ["fid", "is", "precision", "recall"]
    run = tmp_path / "run"
    with accelerate_state():
        train(tiny_config(run, "train.max_steps=2", "train.ckpt_every=2", "train.eval_every=2", "eval.num_samples=8",
                          "eval.batch_size=4", "eval.sampler=ddpm", "eval.steps=3", "eval.cfg_scales=[1.5]",
                          "eval.heldout_loss=false", f"eval.metrics=[{','.join(metrics)}]", f"eval.ref={ref}",
                          f"eval.inception_weights={weights}"))
    (entry,) = read_evals(run)
    during = entry["metrics"]
    assert set(during) == {f"{m}/cfg1.5" for m in metrics}
    assert during["fid/cfg1.5"] > 0 and during["is/cfg1.5"] > 1.0

    samples = tmp_path / "samples.npz"
    with accelerate_state():
        load_script(ROOT / "sample.py").main(["--ckpt", str(run / "checkpoints" / "0000002"), "--num-samples", "8",
                                              "--batch-size", "4", "--sampler", "ddpm", "--steps", "3",
                                              "--cfg-scale", "1.5", "--seed", "0", "--out", str(samples), "--cpu"])
    offline = evaluate(samples, ref, weights, metrics=tuple(metrics), fid_method="eigh", device="cpu").metrics
    for m in metrics:
        assert during[f"{m}/cfg1.5"] == pytest.approx(offline[m], rel=1e-5), m


@pytest.mark.slow
def test_the_reference_features_are_ready_before_the_first_step(tmp_path):
    """The main process extracts eval.ref's features while the trainer is built, not at the first
    evaluation in the middle of training (where the other ranks would wait for it in a collective)."""
    from ancre_dit.data.adm_npz import save_adm_npz, to_uint8
    from ancre_dit.data.digits import DigitsDataset
    from ancre_dit.evaluation import WEIGHTS_NAME, write_random_inception_weights
    from ancre_dit.training import Trainer
    from ancre_dit.training.periodic import EvaluationTask

    weights = write_random_inception_weights(tmp_path / WEIGHTS_NAME, seed=0)
    held = DigitsDataset("heldout")
    ref = save_adm_npz(tmp_path / "ref.npz", to_uint8(held.images[:6]).transpose(0, 2, 3, 1), held.labels[:6].numpy())
    with accelerate_state():
        trainer = Trainer(tiny_config(tmp_path / "run", "train.max_steps=2", "train.eval_every=2",
                                      "eval.metrics=[fid,precision]", f"eval.ref={ref}",
                                      f"eval.inception_weights={weights}", "eval.heldout_loss=false"))
    (task,) = [t for t in trainer.tasks if isinstance(t, EvaluationTask)]
    side = task.evaluator._ref_side
    assert trainer.step == 0 and side is not None and side.num_images == 6 and len(side.features.pool) == 6
