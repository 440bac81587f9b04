"""Several EMAs in one run and post-hoc EMA: each EMA is the one a run of that decay alone keeps, all
of them and the snapshots resume bitwise, sample.py picks one, and scripts/reconstruct_ema.py rebuilds
a tracked length from the snapshots."""
from __future__ import annotations

import pytest
import torch
from helpers import ROOT, accelerate_state, load_script, tiny_config, train_straight_and_resumed
from safetensors.torch import load_file

from ancre_dit.checkpoint import load_trained_model
from ancre_dit.errors import UserError
from ancre_dit.training import train

PHEMA = ["train.phema.stds=[0.05,0.1]", "train.phema.snapshot_every=1"]


def _weights(folder, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"{name}.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_each_extra_ema_is_the_ema_a_run_of_that_decay_keeps(tmp_path):
    with accelerate_state():
        train(tiny_config(tmp_path / "alone", "train.ema_decay=0.5", "train.max_steps=3"))
    with accelerate_state():
        train(tiny_config(tmp_path / "several", "train.ema_decay=0.99", "train.ema_decays=[0.5,0.9]",
                          "train.max_steps=3"))
    alone, several = tmp_path / "alone/checkpoints/0000003", tmp_path / "several/checkpoints/0000003"
    assert _same(_weights(alone, "ema"), _weights(several, "ema-0.5"))
    assert not _same(_weights(several, "ema-0.9"), _weights(several, "ema-0.5"))
    assert _same(_weights(alone, "model"), _weights(several, "model"))  # the EMAs do not touch training


@pytest.mark.slow
def test_the_emas_and_the_snapshots_resume_bitwise(tmp_path):
    last = train_straight_and_resumed(tmp_path, "train.ema_decays=[0.5]", *PHEMA, steps=4, stop_at=2)
    straight = tmp_path / "straight/checkpoints/0000004"
    for name in ("ema-0.5", "phema-0.05", "phema-0.1"):
        assert _same(_weights(straight, name), _weights(last, name)), name
    for step in range(1, 5):
        snapshot = f"phema/{step:07d}.safetensors"
        assert _same(load_file(str(tmp_path / "straight" / snapshot)), load_file(str(tmp_path / "resumed" / snapshot)))


@pytest.mark.slow
def test_a_tracked_length_rebuilt_from_the_snapshots_is_the_tracked_ema(tmp_path, capsys):
    run = tmp_path / "run"
    with accelerate_state():
        train(tiny_config(run, *PHEMA, "train.max_steps=6", "train.ckpt_every=3"))
    out = tmp_path / "rebuilt"
    load_script(ROOT / "scripts" / "reconstruct_ema.py").main([str(run), "--std", "0.1", "--out", str(out)])
    assert "from 6 snapshots" in capsys.readouterr().out
    model, spec = load_trained_model(out)
    assert spec["step"] == 6 and spec["posthoc_ema"]["std"] == 0.1
    tracked = _weights(run / "checkpoints/0000006", "phema-0.1")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, tracked[name], rtol=1e-5, atol=1e-6, msg=name)
    # Another length: a real combination, not one snapshot.
    load_script(ROOT / "scripts" / "reconstruct_ema.py").main([str(run), "--std", "0.07", "--at", "5",
                                                              "--out", str(tmp_path / "other")])
    other, spec = load_trained_model(tmp_path / "other")
    assert spec["step"] == 5 and any(not torch.equal(v, tracked[k]) for k, v in other.state_dict().items())
    with pytest.raises(UserError, match="no post-hoc EMA snapshots .* up to step 0"):
        load_script(ROOT / "scripts" / "reconstruct_ema.py").main([str(run), "--std", "0.1", "--at", "0",
                                                                  "--out", str(tmp_path / "none")])


@pytest.mark.slow
def test_sample_py_picks_an_ema_by_name(tmp_path):
    with accelerate_state():
        train(tiny_config(tmp_path / "run", "train.ema_decays=[0.5]", "train.max_steps=2"))
    ckpt = tmp_path / "run/checkpoints/0000002"
    model, _ = load_trained_model(ckpt, "ema-0.5")
    assert _same(model.state_dict(), _weights(ckpt, "ema-0.5"))
    sample = load_script(ROOT / "sample.py").main
    sample(["--ckpt", str(ckpt), "--ema", "0.5", "--num-samples", "2", "--steps", "3", "--out", str(tmp_path / "a.npz")])
    assert (tmp_path / "a.npz").is_file()
    with pytest.raises(UserError, match=r"--ema 0\.7: .* holds no ema-0\.7\.safetensors; its EMAs: 0\.5"):
        sample(["--ckpt", str(ckpt), "--ema", "0.7", "--out", str(tmp_path / "b.npz")])


@pytest.mark.parametrize("overrides, message", [
    (["train.phema.stds=[0.05]"], "train.phema.stds needs train.phema.snapshot_every"),
    (["train.phema.snapshot_every=10"], "train.phema.snapshot_every needs train.phema.stds"),
    (["train.phema.stds=[0.5]", "train.phema.snapshot_every=10"], "train.phema.stds holds 0.5; a power-function"),
    (["train.phema.stds=[0.1,0.1]", "train.phema.snapshot_every=10"], "repeats a std"),
    (["train.ema_decays=[1.5]"], "train.ema_decays must be less than or equal to 1, got 1.5"),
    (["train.ema_decays=[0.5,0.5]"], "train.ema_decays holds 0.5, given twice"),
    (["train.ema_decays=[0.9]"], "train.ema_decays holds 0.9, the decay of train.ema_decay"),
])
def test_ema_settings_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
        tiny_config(tmp_path, *overrides)


@pytest.mark.slow
def test_the_evaluation_scores_each_ema_named_and_draws_a_line_for_each(tmp_path, monkeypatch):
    """In training and by evaluate.py --run: `ema`'s metrics as they are, another's as <metric>@<name>,
    the same numbers either way; quality.png puts the EMAs of one metric in one panel."""
    import ancre_dit.figures as figures
    from ancre_dit.training.run_evaluation import evaluate_run, read_evals

    drawn = {}
    real_plot = figures.plot_panels
    monkeypatch.setattr(figures, "plot_panels", lambda panels, path, **kw: (drawn.update(panels), real_plot(
        panels, path, **kw))[1])
    settings = ["train.ema_decays=[0.5]", "train.max_steps=2", "train.eval_every=2", "train.ckpt_every=2",
                "eval.emas=[ema,ema-0.5]", "eval.num_samples=8", "eval.batch_size=8", "eval.steps=3",
                "eval.heldout_draws=1", "eval.heldout_max=8", "log.figures=true"]
    with accelerate_state():
        train(tiny_config(tmp_path / "run", *settings))
    (entry,) = read_evals(tmp_path / "run")
    metrics = entry["metrics"]
    assert {"heldout_loss", "heldout_loss@ema-0.5", "digits_acc/cfg1", "digits_acc/cfg1@ema-0.5"} <= set(metrics)
    assert metrics["heldout_loss"] != metrics["heldout_loss@ema-0.5"]
    assert set(drawn["heldout_loss"]) == {"ema", "ema-0.5"} and "heldout_loss@ema-0.5" not in drawn
    (tmp_path / "run/logs/evals.jsonl").unlink()
    with accelerate_state():
        (again,) = evaluate_run(tmp_path / "run", cpu=True, log=lambda *a: None)
    assert again["metrics"] == pytest.approx(metrics)
    with pytest.raises(UserError, match="eval.emas names ema-0.7, which this run does not keep; choose from ema, "
                                        "ema-0.5"):
        tiny_config(tmp_path / "x", "train.ema_decays=[0.5]", "eval.emas=[ema-0.7]")


@pytest.mark.slow
def test_the_ema_sweep_scores_each_std_and_the_fixed_ema_on_two_seeds(tmp_path):
    from ancre_dit.training.ema_sweep import SWEEP_FILE, sweep_ema
    from ancre_dit.training.run_evaluation import evaluate_run

    run = tmp_path / "run"
    eval_settings = ["eval.num_samples=8", "eval.batch_size=8", "eval.steps=3", "eval.heldout_draws=1",
                     "eval.heldout_max=8"]
    with accelerate_state():
        train(tiny_config(run, *PHEMA, "train.max_steps=4", "train.ckpt_every=4", *eval_settings))
    with accelerate_state():
        sweep = sweep_ema(run, [0.1, 0.07], cpu=True, log=lambda *a: None)
    assert sweep["step"] == 4 and (run / SWEEP_FILE).is_file()
    assert list(sweep["metrics"]) == ["ema", "std 0.1", "std 0.07"]
    assert all(len(per_seed) == 2 for per_seed in sweep["metrics"].values())
    assert sweep["metrics"]["ema"][0] != sweep["metrics"]["ema"][1]  # another evaluation seed, other samples
    with accelerate_state():
        (entry,) = evaluate_run(run, cpu=True, log=lambda *a: None)  # eval.seed 0: the sweep's first seed
    ours = sweep["metrics"]["ema"][0]  # (the sweep scores no raw model: no heldout_*_raw)
    assert ours == pytest.approx({k: entry["metrics"][k] for k in ours}) and "digits_fd/cfg1" in ours


def test_the_sweeps_verdict_pairs_each_seeds_pick_with_its_fixed_ema():
    from ancre_dit.training.ema_sweep import compare_sweeps

    def sweep(ema: float, stds: dict[str, tuple[float, float]]) -> dict:
        return {"metrics": {"ema": [{"digits_fd/cfg2": ema}, {"digits_fd/cfg2": ema}],
                            **{k: [{"digits_fd/cfg2": a}, {"digits_fd/cfg2": b}] for k, (a, b) in stds.items()}}}

    better = {f"s{i}": sweep(10.0, {"std 0.05": (9.0 + i, 9.0 - 0.1 * i), "std 0.1": (20.0, 1.0)}) for i in range(3)}
    text = compare_sweeps(better, "digits_fd/cfg2")
    # The pick is made on seed A (std 0.05: 9, 10, 11 beat 20), scored on seed B: 9.0, 8.9, 8.8 against 10.
    assert "s0: best std 0.05 -> 9" in text and "difference -1.2" in text.splitlines()[3]
    assert text.endswith("post-hoc EMA is better")
    mixed = {f"s{i}": sweep(10.0, {"std 0.05": (1.0, 10.0 + d)}) for i, d in enumerate((-1.0, 1.0, 0.5))}
    assert compare_sweeps(mixed, "digits_fd/cfg2").endswith("no measurable difference")
    with pytest.raises(UserError, match="has no fid/cfg1; choose one of digits_fd/cfg2"):
        compare_sweeps(mixed, "fid/cfg1")


@pytest.mark.slow
def test_sample_py_takes_a_post_hoc_ema_of_a_checkpoint_by_its_file_name(tmp_path):
    with accelerate_state():
        train(tiny_config(tmp_path / "run", *PHEMA, "train.max_steps=2"))
    ckpt = tmp_path / "run/checkpoints/0000002"
    load_script(ROOT / "sample.py").main(["--ckpt", str(ckpt), "--ema", "phema-0.05", "--num-samples", "2",
                                          "--steps", "3", "--out", str(tmp_path / "a.npz")])
    assert (tmp_path / "a.npz").is_file()
    with pytest.raises(UserError, match=r"holds no ema-0\.5\.safetensors; its EMAs: phema-0\.05, phema-0\.1"):
        load_script(ROOT / "sample.py").main(["--ckpt", str(ckpt), "--ema", "0.5", "--out", str(tmp_path / "b.npz")])


def test_a_length_out_of_range_is_one_line_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match=r"--std holds 0\.5; a power-function EMA's std lies in \(0, 0\.2887\)"):
        load_script(ROOT / "scripts" / "reconstruct_ema.py").main([str(tmp_path), "--std", "0.5", "--out",
                                                                  str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_ema_takes_the_sparse_wiring_when_the_topology_is_sparsified(tmp_path):
    """Each EMA, not only the one sampling reads, keeps the training weights' edges from the switch
    step on, so an evaluation of any of them samples the sparse network."""
    from ancre_dit.training import Trainer

    with accelerate_state():
        trainer = Trainer(tiny_config(tmp_path / "run", "model.depth=4", "model.topology_topk=1",
                                      "train.topology_sparsify_step=2", "train.max_steps=3", "train.ema_decays=[0.5]",
                                      *PHEMA))
        try:
            trainer.run()
            kept = trainer.raw_model.topology.kept
            for name, ema in trainer.emas.items():
                topology = ema.module.topology
                assert topology.is_sparse and torch.equal(topology.kept, kept), name
                assert all(len(edges) == 1 for edges in topology.edges), name
        finally:
            trainer.accelerator.end_training()
