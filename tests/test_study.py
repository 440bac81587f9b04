"""Studies (scripts/study.py, ancre_dit.studies): the study file and its arm names, dry runs that
validate every run and write nothing, one-line errors, a tiny study run twice (the rerun skips
finished runs), a failed run that stays listed as failed, the report's seed statistics against hand
computations, and the submitit path (local executor) including a preemption that requeues and
resumes from the checkpoint training writes on SIGTERM."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.stats import t as student_t

from helpers import ROOT, load_script

from ancre_dit.cli import run_cli
from ancre_dit.studies.comparison import (PairedSpeedup, SeedSpeedup, interval_curve, paired_difference,
                                             paired_speedup, verdict)
from ancre_dit.studies.run_curves import Group, load_run
from ancre_dit.files import read_jsonl
from ancre_dit.studies import load_study
from ancre_dit.studies.ownership import claim_folder
from ancre_dit.studies.spec import yaml_value

STUDY_SCRIPT = ROOT / "scripts" / "study.py"
TRAIN_SCRIPT = ROOT / "train.py"
# The suite's tiny DiT (2 blocks of width 32) on the quickstart's flow-matching digits: 20 steps,
# evaluated every 10 (held-out loss and the digits metric on 20 samples); no run draws figures (the
# report draws its own from the runs' logs).
TINY = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "train.max_steps": 20,
        "train.eval_every": 10, "train.global_batch_size": 16, "train.ckpt_every": 1000, "train.sample_every": 0,
        "train.log_every": 5, "log.tensorboard": False, "log.figures": False, "eval.num_samples": 20, "eval.batch_size": 20,
        "eval.steps": 2, "eval.heldout_draws": 1, "eval.heldout_max": 50}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Children (train.py, submitit's jobs) run this checkout on the CPU."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.delenv("ANCRE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def write_study(path: Path, **fields) -> Path:
    study = {"out": str(path.parent / "out"), "base": str(ROOT / "configs" / "quickstart.yaml"), "overrides": TINY,
             "arms": {"cascaded": {"model.topology": "cascaded"}}, "grid": {"model.topology": ["ancre"],
                                                                            "model.tau": [0.1]},
             "seeds": [0, 1], "baseline": "cascaded"}
    study.update(fields)
    path.write_text(yaml.safe_dump({k: v for k, v in study.items() if v is not None}, sort_keys=False))
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """scripts/study.py in this process: (exit code, stdout, stderr)."""
    module = load_script(STUDY_SCRIPT)
    with pytest.raises(SystemExit) as info:
        run_cli(lambda: module.main(list(argv)))
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


# -- the study file --------------------------------------------------------------------------------
def test_spec_arms_names_and_run_overrides(tmp_path):
    path = write_study(tmp_path / "s.yaml", arms={"cascaded": {"model": {"topology": "cascaded"}}},
                       grid={"model.topology": ["ancre"], "model.tau": [0.01, 0.3], "model.topology_init": ["first"]})
    study = load_study(path)
    assert list(study.arms) == ["cascaded", "ancre-tau0.01-first", "ancre-tau0.3-first"]
    assert study.arms["cascaded"] == {"model.topology": "cascaded"}  # nested mappings are flattened
    assert study.arms["ancre-tau0.3-first"] == {"model.topology": "ancre", "model.tau": 0.3, "model.topology_init": "first"}
    jobs = study.jobs
    assert [j.name for j in jobs] == ["cascaded-s0", "ancre-tau0.01-first-s0", "ancre-tau0.3-first-s0",  # seed by seed
                                      "cascaded-s1", "ancre-tau0.01-first-s1", "ancre-tau0.3-first-s1"]
    job = jobs[4]
    assert job.run_dir == tmp_path / "out" / "runs" / "ancre-tau0.01-first-s1" and job.seed == 1
    assert job.overrides[-4:] == ("model.tau=0.01", "model.topology_init=first", "train.seed=1", f"run_dir={job.run_dir}")
    assert job.overrides[0] == "model.depth=2"
    default = load_study(write_study(tmp_path / "t.yaml", out=None)).out
    assert default.is_absolute() and default.parts[-3:] == ("results", "studies", "t")
    # values survive the trip through `key=value` text
    for value in (0.01, 1e-4, "1e-4", "no", None, True, [1.0, 1.5], "first"):
        assert yaml.safe_load(yaml_value(value)) == value


def test_dry_run_validates_every_run_and_creates_nothing(tmp_path, capsys, env):
    path = write_study(tmp_path / "s.yaml")
    code, out, err = cli(capsys, "run", str(path), "--dry-run")
    assert code == 0, err
    assert "2 arms x 2 seeds = 4 runs, all configs valid" in out
    assert "ancre-tau0.1-s1" in out and "model.topology=ancre, model.tau=0.1" in out
    assert not (tmp_path / "out").exists()


def _bill(out: str) -> dict[str, list[str]]:
    lines = out[out.index("training compute at"):].splitlines()
    return {line.split()[0]: line.split() for line in lines[3:] if line and not line.startswith("total")}


@pytest.mark.slow
def test_dry_run_prices_each_arm_in_gpu_hours(tmp_path, capsys, env):
    from ancre_dit.studies.costs import flops_per_image

    path = write_study(tmp_path / "s.yaml", overrides={**TINY, "train.max_steps": 1000})
    code, out, err = cli(capsys, "run", str(path), "--dry-run")
    assert code == 0, err
    assert "at 40% MFU of 989 TFLOP/s per GPU (default MFU 40%; peak of an H100/H200 (default)" in out
    # The tiny DiT on 8x8x1 digits: FLOPs per image counted from the config, x batch 16 x 1000 steps x 2 seeds.
    per_image = flops_per_image({"model": {"name": "DiT-T/2", "kwargs": dict(
        topology="cascaded", input_size=8, in_channels=1, num_classes=10, learn_sigma=False, class_dropout_prob=0.1,
        depth=2, hidden_size=32, num_heads=2)}})
    hours = per_image * 16 * 1000 * 2 / (0.4 * 989e12) / 3600
    row = _bill(out)["cascaded"]
    assert row[1:4] == ["2", f"{per_image * 16 / 1e12:.3g}", "1000"] and float(row[5].replace(",", "")) == \
        pytest.approx(hours, abs=0.06)
    # Half the MFU: twice the hours; an A100's peak from the table; a GPU check's measured trainer MFU.
    check = tmp_path / "gpu_check.json"
    check.write_text(json.dumps({"trainer": {"mfu": 0.2, "peak_tflops": 312.0, "device": "NVIDIA A100"}}))
    for flags, mfu, peak in ((["--mfu", "0.2"], 0.2, 989), (["--gpu", "A100"], 0.4, 312),
                             (["--gpu-peak-tflops", "500"], 0.4, 500), (["--gpu-check", str(check)], 0.2, 312)):
        code, out, err = cli(capsys, "run", str(path), "--dry-run", *flags)
        assert code == 0 and f"at {mfu:.0%} MFU of {peak:g} TFLOP/s" in out, (flags, err)
    for flags, message in ((["--mfu", "40"], "--mfu 40.0 must be a fraction"), (["--gpu", "Z9"], "--gpu Z9: no peak"),
                           (["--mfu", "0.3"], "add --dry-run")):
        code, _, err = cli(capsys, "run", str(path), *(["--dry-run"] if "add" not in message else []), *flags)
        assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_config_model_is_the_trained_model(tmp_path, tiny_run_config, fresh_accelerate):
    """The bill counts the network the trainer builds: the kwargs from a config equal a run's spec."""
    from ancre_dit.checkpoint import load_model_spec
    from ancre_dit.studies.costs import data_shape
    from ancre_dit.training import train
    from ancre_dit.training.model_setup import model_kwargs

    config = tiny_run_config("train.max_steps=1", "train.ckpt_every=1", "model.norm=rmsnorm")
    train(config)
    size, channels, classes, _ = data_shape(config)
    saved = load_model_spec(Path(config.run_dir) / "checkpoints" / "0000001")
    assert json.loads(json.dumps(model_kwargs(config.model, size, channels, classes))) == saved["model"]["kwargs"]


SHIPPED = sorted(p.stem for p in (ROOT / "studies").glob("*.yaml"))


@pytest.mark.slow  # the bill counts DiT-B/2's FLOPs for each topology
@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("imagenet")])
def test_imagenet_studies_validate_without_their_data(name, capsys, tmp_path):
    code, out, err = cli(capsys, "run", str(ROOT / "studies" / f"{name}.yaml"), "--dry-run", "--no-check-paths")
    assert code == 0, err
    assert re.search(r"\d+ arms x 3 seeds = \d+ runs, all configs valid", out) and "400000" in out
    assert "not checked (missing here, --no-check-paths): data.path=" in out
    if not Path("/data/imagenet256-latents").exists():  # with the checks: the missing data is one line
        code, _, err = cli(capsys, "run", str(ROOT / "studies" / f"{name}.yaml"), "--dry-run")
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "data path" in err


@pytest.mark.slow  # the bill counts the FLOPs of each arm's model
@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("digits")])
def test_digits_studies_validate(name, capsys):
    code, out, err = cli(capsys, "run", str(ROOT / "studies" / f"{name}.yaml"), "--dry-run")
    assert code == 0, err
    assert "cascaded-s2" in out  # every digits study has the plain DiT, on seeds 0-2


BAD = [
    (dict(arms={"cascaded": {}, "typo": {"model.taux": 1}}), "arm typo (seed 0): unknown config key model.taux"),
    (dict(grid={"model.depthh": [2]}), "arm depthh2 (seed 0): unknown config key model.depthh"),
    (dict(arms=None, grid={}), "no arms"),
    (dict(grid={"model.tau": []}), "must be a non-empty list"),
    (dict(baseline="plain"), "baseline 'plain' is not among the arms"),
    (dict(base="configs/nowhere.yaml"), "base config configs/nowhere.yaml not found"),
    (dict(seeds=[]), "seeds must be a non-empty list"),
    (dict(seeds=[0, "one"]), "seeds must be integers"),
    (dict(seeds=[0, 0]), "repeat a seed"),
    (dict(arms={"ancre-tau0.1": {"model.topology": "ancre"}}), "duplicate arm name 'ancre-tau0.1'"),
    (dict(arms={"cascaded": {"train.seed": 3}}), "sets train.seed"),
    (dict(flavour=1), "unknown key 'flavour'"),
    (dict(arms={"bad/name": {}}), "arm name 'bad/name'"),
    (dict(arms=None, grid={"model.depth": [2, 4], "model.topology": ["ancre"]}, baseline={"model.topology": "cascaded"}),
     "arm depth2-ancre has no baseline arm"),
]


@pytest.mark.parametrize("fields, message", BAD)
def test_bad_study_is_one_line(fields, message, tmp_path, capsys, env):
    code, _, err = cli(capsys, "run", str(write_study(tmp_path / "s.yaml", **fields)), "--dry-run")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_duplicate_arm_in_the_yaml_and_another_studys_folder_are_refused(tmp_path, capsys, env):
    path = tmp_path / "dup.yaml"
    path.write_text(f"base: {ROOT / 'configs' / 'quickstart.yaml'}\nseeds: [0]\narms:\n  a: {{model.tau: 0.1}}\n"
                    f"  a: {{model.tau: 0.2}}\n")
    code, _, err = cli(capsys, "run", str(path), "--dry-run")
    assert code == 2 and "'a' is given twice" in err and err.count("\n") == 1

    from ancre_dit.studies.ownership import claim_folder
    claim_folder(load_study(write_study(tmp_path / "a.yaml")))
    other = write_study(tmp_path / "b.yaml", overrides={**TINY, "train.lr": 0.01})
    code, _, err = cli(capsys, "run", str(other), "--dry-run")
    assert code == 2 and "holds another study (a, from" in err and err.count("\n") == 1
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, "status", str(write_study(tmp_path / "c.yaml", out=str(tmp_path / "stranger"))))
    assert code == 2 and "holds no study (study.json missing)" in err
    code, _, err = cli(capsys, "report", str(write_study(tmp_path / "d.yaml", out=str(tmp_path / "fresh"))))
    assert code == 2 and "holds no run of this study yet" in err and not (tmp_path / "fresh").exists()
    code, _, err = cli(capsys, "run", str(tmp_path / "d.yaml"), "--jobs", "2", "--executor", "slurm")
    assert code == 2 and "--jobs applies to --executor local" in err


def test_cores_and_gpus_are_split_between_parallel_runs(monkeypatch):
    from ancre_dit.studies import runner

    monkeypatch.setattr(runner, "usable_cores", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the study's own GPUs: the runs share those
    assert [runner.slot_environment(k, 2, gpus=2)["CUDA_VISIBLE_DEVICES"] for k in (0, 1)] == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    env = runner.slot_environment(1, 4, gpus=2)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert runner.slot_environment(2, 4, gpus=2)["CUDA_VISIBLE_DEVICES"] == "0"
    alone = runner.slot_environment(0, 1, gpus=2)
    assert alone["OMP_NUM_THREADS"] == "16" and alone.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert runner.slot_environment(0, 32, gpus=0)["OMP_NUM_THREADS"] == "1"


# -- statistics against hand computations ----------------------------------------------------------
def fake_run(root: Path, name: str, seed: int, evals: dict[int, float], metric: str = "heldout_loss"):
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed, "global_batch_size": 4}}))
    (run / "logs" / "evals.jsonl").write_text("".join(json.dumps({"step": s, "metrics": {metric: v}, "settings": {}})
                                                      + "\n" for s, v in evals.items()))
    return load_run(run)


def test_t_interval_curve_and_flops_axis(tmp_path):
    a = fake_run(tmp_path, "a", 0, {10: 1.0, 20: 0.6})
    b = fake_run(tmp_path, "b", 1, {10: 0.8, 20: 0.5})
    x, mean, half = interval_curve(Group("g", [a, b]), "heldout_loss")
    assert x.tolist() == [10, 20] and mean.tolist() == pytest.approx([0.9, 0.55])
    # n = 2: half width = t(0.975, 1) * s / sqrt(2), s = |a - b| / sqrt(2)
    t1 = 12.706204736
    assert half.tolist() == pytest.approx([t1 * 0.2 / math.sqrt(2) / math.sqrt(2), t1 * 0.1 / 2], rel=1e-6)
    a.flops_per_step = b.flops_per_step = 1e9
    assert interval_curve(Group("g", [a, b]), "heldout_loss", "flops")[0].tolist() == [1e10, 2e10]
    assert interval_curve(Group("one", [a]), "heldout_loss")[2] is None


def test_paired_speedup_difference_and_a_censored_seed(tmp_path):
    steps = [100, 200, 300, 400]
    base = [fake_run(tmp_path, f"b{s}", s, dict(zip(steps, v))) for s, v in
            enumerate([[0.9, 0.7, 0.6, 0.5], [0.8, 0.7, 0.6, 0.55], [0.9, 0.8, 0.7, 0.7]])]
    # targets 0.5, 0.55, 0.7; the baseline reaches them at 400, 400, 300
    arm = [fake_run(tmp_path, f"a{s}", s, dict(zip(steps, v))) for s, v in
           enumerate([[0.7, 0.5, 0.45, 0.4], [0.5, 0.5, 0.5, 0.5], [0.75, 0.7, 0.6, 0.6]])]
    result = paired_speedup(base, arm, "heldout_loss")
    assert [(s.seed, s.target, s.baseline_steps, s.arm_steps) for s in result.seeds] == [
        (0, 0.5, 400, 200), (1, 0.55, 400, 100), (2, 0.7, 300, 200)]
    logs = [math.log(2.0), math.log(4.0), math.log(1.5)]
    mean, sd = sum(logs) / 3, float(np.std(logs, ddof=1))
    half = student_t.ppf(0.975, 2) * sd / math.sqrt(3)
    assert result.geomean == pytest.approx(12 ** (1 / 3))
    assert (result.low, result.high) == (pytest.approx(math.exp(mean - half)), pytest.approx(math.exp(mean + half)))
    assert result.low < 1  # three seeds this spread: not enough
    assert verdict(result).startswith("no difference detected at this budget (speedup 2.29x [")

    diff = paired_difference(base, arm, "heldout_loss")  # 0.4 - 0.5, 0.5 - 0.55, 0.6 - 0.7
    d = [-0.1, -0.05, -0.1]
    assert diff.mean == pytest.approx(sum(d) / 3)
    assert diff.high - diff.mean == pytest.approx(student_t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3))

    # seed 2's arm never gets to 0.7 by its last step (300): censored, below 300 / 300; no interval
    arm[2] = fake_run(tmp_path, "a2c", 2, {100: 0.9, 200: 0.8, 300: 0.75})
    censored = paired_speedup(base, arm, "heldout_loss")
    assert censored.reached == 2 and censored.geomean is None and censored.low is None
    assert (censored.seeds[2].arm_steps, censored.seeds[2].bound) == (None, 1.0)
    assert verdict(censored) == "no difference detected at this budget (not reached by 1 of 3 seeds: no interval)"
    # higher is better: >= the target
    acc = paired_speedup([fake_run(tmp_path, "ab", 0, {1: 0.2, 2: 0.8}, "digits_acc/cfg2")],
                         [fake_run(tmp_path, "aa", 0, {1: 0.9, 2: 0.95}, "digits_acc/cfg2")], "digits_acc/cfg2")
    assert (acc.seeds[0].baseline_steps, acc.seeds[0].arm_steps, acc.geomean) == (2, 1, 2.0)


def speedups(values, reached=None, low=None, high=None) -> PairedSpeedup:
    seeds = [SeedSpeedup(i, 0.5, 100, None if v is None else 50, 200, v, None if v else 0.5) for i, v in enumerate(values)]
    geo = None if None in values else math.exp(sum(map(math.log, values)) / len(values))
    return PairedSpeedup("heldout_loss", True, seeds, geo, low, high, 0.95)


def test_verdict_wording():
    assert verdict(speedups([1.2, 1.3, 1.4], low=1.1, high=1.6)) == "faster by 1.3x [1.1, 1.6]"
    assert verdict(speedups([0.8, 0.85, 0.82], low=0.7, high=0.9)) == "slower by 1.21x [1.11, 1.43]"
    assert verdict(speedups([0.9, 1.1, 1.0], low=0.8, high=1.2)).startswith("no difference detected at this budget")
    assert verdict(speedups([None, None, 1.0])) == "slower: the baseline's final value not reached by 2 of 3 seeds"
    assert verdict(speedups([2.0])) == "no difference detected at this budget (1 seed: no interval; speedup 2x)"


# -- running -----------------------------------------------------------------------------------------
def events(run_dir: Path) -> list[str]:
    return [e["event"] for e in read_jsonl(run_dir / "study_status.jsonl")]


@pytest.mark.slow
def test_tiny_study_runs_reruns_reports_and_lists_a_failed_run(tmp_path, capsys, env):
    path = write_study(tmp_path / "tiny.yaml")
    code, out, err = cli(capsys, "run", str(path), "--jobs", "2")
    assert code == 0, err + out
    assert "4 of 4 launched runs finished" in out
    runs = tmp_path / "out" / "runs"
    for name in ("cascaded-s0", "cascaded-s1", "ancre-tau0.1-s0", "ancre-tau0.1-s1"):
        assert (runs / name / "checkpoints" / "0000020").is_dir() and (runs / name / "study.log").is_file()
        assert events(runs / name) == ["started", "finished"]
        config = yaml.safe_load((runs / name / "config.yaml").read_text())
        assert config["train"]["seed"] == int(name[-1]) and config["model"]["depth"] == 2
    assert json.loads((tmp_path / "out" / "study.json").read_text())["name"] == "tiny"

    code, out, _ = cli(capsys, "status", str(path))
    assert code == 0 and out.count(" done ") == 4 and "20/20" in out and "4 done" in out
    code, out, _ = cli(capsys, "run", str(path), "--jobs", "2")  # rerun: nothing left to do
    assert code == 0 and "4 finished already (skipped), 0 to run" in out
    assert events(runs / "cascaded-s0") == ["started", "finished"]

    code, out, _ = cli(capsys, "report", str(path))
    report = (tmp_path / "out" / "report" / "report.md").read_text()
    assert code == 0 and "95% Student-t intervals" in report
    assert "| cascaded | 2 | " in report and " [" in report  # mean [low, high] over the two seeds
    assert "- **heldout_loss**, ancre-tau0.1: " in report and "- **digits_acc/cfg2**, ancre-tau0.1: " in report
    verdicts = [line for line in report.splitlines() if line.startswith("- **") and "**, " in line]
    assert verdicts and all(any(w in line for w in ("faster by", "slower", "no difference detected")) for line in verdicts)
    for axis in ("step", "images", "seconds", "flops"):
        assert (tmp_path / "out" / "report" / f"curves_{axis}.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())
    assert summary["flops_per_step"]["cascaded"] > 0

    # The same study grown by an arm whose data cannot load: it fails, the others are kept.
    empty = tmp_path / "no-latents"
    empty.mkdir()
    grown = write_study(tmp_path / "tiny.yaml", seeds=[0], arms={
        "cascaded": {"model.topology": "cascaded"}, "broken": {"data.kind": "latents", "data.path": str(empty)}})
    code, out, err = cli(capsys, "run", str(grown))
    assert code == 1 and "2 finished already (skipped), 1 to run" in out and "broken-s0 (failed)" in out
    assert events(runs / "broken-s0") == ["started", "failed"]
    code, out, _ = cli(capsys, "status", str(grown))
    assert "broken-s0" in out and " failed " in out and "exit code 2: error: " in out and "1 failed" in out
    cli(capsys, "report", str(grown))
    report = (tmp_path / "out" / "report" / "report.md").read_text()
    assert "| broken-s0 | broken | 0 | failed (exit 2: error: " in report and "not used: broken-s0" in report


@pytest.mark.slow
def test_status_and_report_of_a_frozen_arm_whose_topology_file_is_elsewhere(tmp_path, capsys, env, fresh_accelerate):
    """The topology.json a frozen arm trained from lies outside the study folder (here: on the
    machine that trained it, gone from this one): status, report and the FLOPs of the arm read the
    run, which holds the matrix in its checkpoint."""
    import torch

    from ancre_dit.models import save_topology_json
    from ancre_dit.studies.spec import job_config
    from ancre_dit.training import train

    elsewhere = tmp_path / "elsewhere" / "topology.json"
    elsewhere.parent.mkdir()
    save_topology_json(elsewhere, torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    path = write_study(tmp_path / "frozen.yaml", seeds=[0], grid=None, arms={
        "cascaded": {"model.topology": "cascaded"},
        "frozen": {"model.topology": "frozen", "model.topology_path": str(elsewhere)}})
    study = load_study(path)
    claim_folder(study)
    for job in study.jobs:
        train(job_config(study, job))
    elsewhere.unlink()
    code, out, err = cli(capsys, "status", str(path))
    assert code == 0, err
    assert "frozen-s0" in out and "2 done" in out
    code, out, err = cli(capsys, "report", str(path))
    assert code == 0, err
    summary = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())
    assert summary["flops_per_step"]["frozen"] > 0
    assert "| frozen |" in (tmp_path / "out" / "report" / "report.md").read_text()
    # Where the paths are checked (a run, a dry run without --no-check-paths), the missing file is one line.
    code, _, err = cli(capsys, "run", str(path), "--dry-run")
    assert code == 2 and f"model.topology_path {elsewhere} not found" in err and err.count("\n") == 1


@pytest.mark.slow
def test_submitit_local_executor_runs_and_requeues_a_preempted_run(tmp_path, capsys, env, monkeypatch):
    """The cluster path on this machine: two runs as submitit jobs; one receives the preemption
    signal mid-training, checkpoints through train.py's SIGTERM handler, is requeued and resumes."""
    from ancre_dit.studies import actions, cluster

    path = write_study(tmp_path / "sub.yaml", arms={"cascaded": {"model.topology": "cascaded"}}, grid=None,
                       overrides={**TINY, "train.max_steps": 300, "train.eval_every": 0, "train.log_every": 5})
    study = load_study(path)
    handles = []
    real_submit = cluster.submit
    monkeypatch.setattr(cluster, "submit", lambda *a, **k: handles.extend(real_submit(*a, **k)) or handles)
    result = {}
    worker = threading.Thread(target=lambda: result.update(code=actions.run_cluster(
        study, TRAIN_SCRIPT, cluster.ClusterOptions(gpus_per_node=0, time_min=10), "local", wait=True)))
    worker.start()
    run = tmp_path / "out" / "runs" / "cascaded-s0"
    deadline = time.monotonic() + 240
    started = []
    while time.monotonic() < deadline and worker.is_alive():
        started = [e for e in read_jsonl(run / "study_status.jsonl") if e["event"] == "started"]
        steps = [r["step"] for r in read_jsonl(run / "logs" / "metrics.jsonl")]
        if started and steps and 5 <= steps[-1] < 250:
            os.kill(started[0]["job_pid"], signal.SIGUSR2)  # what SLURM sends before a time limit / preemption
            break
        time.sleep(0.05)
    assert started, "the job never started training in time"
    worker.join(timeout=300)
    assert result.get("code") == 0
    log = (run / "log.txt").read_text()
    assert "stop requested: saving step" in log and "resumed from" in log
    assert events(run) == ["submitted", "started", "stopped", "started", "finished"]
    for name in ("cascaded-s0", "cascaded-s1"):
        assert (tmp_path / "out" / "runs" / name / "checkpoints" / "0000300" / "ema.safetensors").is_file()
    code, out, _ = cli(capsys, "status", str(path))
    assert out.count(" done ") == 2


def test_slurm_options_reach_sbatch_and_the_runs_show_as_submitted(tmp_path, capsys, env, monkeypatch):
    """No SLURM here: stand-in srun / sbatch commands take the submission, so the job script
    submitit writes from the study's options can be read back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text('#!/bin/sh\nfor last; do :; done\ncp "$last" "$SBATCH_COPY"\n'
                                    'echo "Submitted batch job 4242"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SBATCH_COPY", str(tmp_path / "job.sh"))
    path = write_study(tmp_path / "s.yaml", slurm={"partition": "gpu", "gpus_per_node": 8, "time_min": 600})
    code, out, err = cli(capsys, "run", str(path), "--executor", "slurm", "--account", "acc", "--nodes", "2",
                         "--slurm-array-parallelism", "3")
    assert code == 0, err
    assert "cascaded-s0 (job 4242_0)" in out
    script = (tmp_path / "job.sh").read_text()
    for line in ("--partition=gpu", "--account=acc", "--gpus-per-node=8", "--nodes=2", "--ntasks-per-node=1",
                 "--time=600", "--array=0-3%3", "--signal=USR2@180"):  # cluster.SIGNAL_DELAY_S, docs/cluster.md
        assert f"#SBATCH {line}\n" in script
    code, out, _ = cli(capsys, "status", str(path))
    assert out.count(" submitted ") == 4
    code, _, err = cli(capsys, "run", str(path), "--executor", "slurm")  # not twice
    assert code == 2 and "run cascaded-s0 is submitted" in err and "--force" in err
    # a count in the study's slurm: section is held to the flags' rule, in one line naming the key
    bad = write_study(tmp_path / "bad.yaml", slurm={"nodes": 0}, out=str(tmp_path / "bad"))
    code, _, err = cli(capsys, "run", str(bad), "--executor", "slurm")
    assert code == 2 and err.strip() == "error: slurm.nodes must be a whole number >= 1, got 0"
    code, _, err = cli(capsys, "run", str(path), "--executor", "slurm", "--time-min", "0")
    assert code == 2 and err.strip() == "error: --time-min must be a whole number >= 1, got 0"


def test_multi_gpu_jobs_launch_torchrun_with_the_node_rank():
    from types import SimpleNamespace

    from ancre_dit.studies.cluster import StudyRun

    job = StudyRun("a-s0", "/runs/a-s0", ["train.py", "--config", "c.yaml"], gpus_per_node=8)
    env = SimpleNamespace(num_nodes=2, node=1, hostnames=["node-a", "node-b"], job_id="42_1")
    command = job.command(env)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc_per_node=8", "--node_rank=1", "--master_addr=node-a"} <= set(command)
    assert command[-3:] == ["train.py", "--config", "c.yaml"]
    # torchrun waits for its workers' checkpoint as long as the job's grace, which fits SLURM's early signal
    from ancre_dit.studies.cluster import GRACE_S, SIGNAL_DELAY_S
    assert f"--shutdown-timeout={GRACE_S}" in command and job.grace_s == GRACE_S < SIGNAL_DELAY_S
    single = StudyRun("a-s0", "/runs/a-s0", ["train.py"], gpus_per_node=1).command(SimpleNamespace(num_nodes=1))
    assert single[1:] == ["train.py"]
    import pickle
    assert pickle.loads(pickle.dumps(job)).train_args == job.train_args


@pytest.mark.slow
def test_the_training_child_outlives_slurms_early_signal():
    """SLURM's --signal=USR2@N reaches every process of the job step: the training child ignores it
    (its default action would kill train.py before the job's SIGTERM asks it to checkpoint)."""
    import subprocess
    import sys

    from ancre_dit.studies.cluster import _ignore_submitit_signal

    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(3)"],
                             stdout=subprocess.PIPE, text=True, preexec_fn=_ignore_submitit_signal)
    assert child.stdout.readline() == "up\n"
    child.send_signal(signal.SIGUSR2)
    assert child.wait(timeout=20) == 0


def test_a_baseline_per_arm_compares_each_depth_with_its_own_plain_dit(tmp_path):
    """baseline: {model.topology: cascaded} pairs every arm with the arm equal to it but for the
    topology: the ancre runs at depth 4 against the cascaded runs at depth 4, not at depth 2."""
    from ancre_dit.studies.report import StudyReport

    path = write_study(tmp_path / "d.yaml", arms=None, grid={"model.depth": [2, 4], "model.topology": ["cascaded", "ancre"]},
                       baseline={"model.topology": "cascaded"})
    study = load_study(path)
    assert {arm: study.baseline_of(arm) for arm in study.arms} == {
        "depth2-cascaded": "depth2-cascaded", "depth2-ancre": "depth2-cascaded",
        "depth4-cascaded": "depth4-cascaded", "depth4-ancre": "depth4-cascaded"}
    curves = {"depth2-cascaded": {10: 1.0, 20: 0.5}, "depth2-ancre": {10: 0.9, 20: 0.6},    # slower at depth 2
              "depth4-cascaded": {10: 1.0, 20: 0.8}, "depth4-ancre": {10: 0.7, 20: 0.6}}    # faster at depth 4
    report = StudyReport.__new__(StudyReport)
    report.study = study
    report.groups = {arm: Group(arm, [fake_run(tmp_path / arm, f"s{seed}", seed,
                                               {s: v + 0.01 * seed for s, v in points.items()}) for seed in (0, 1)])
                     for arm, points in curves.items()}
    rows = {r.group: r for r in report.metric_rows("heldout_loss")}
    assert rows["depth2-cascaded"].verdict == rows["depth4-cascaded"].verdict == "baseline"
    assert rows["depth4-ancre"].speedup.geomean == pytest.approx(2.0)  # 20 steps against 10
    assert rows["depth2-ancre"].speedup.reached == 0  # never reaches depth 2's final 0.5
    assert rows["depth4-ancre"].difference.mean == pytest.approx(-0.2)


def test_compare_runs_and_the_study_report_give_the_same_speedups(tmp_path, capsys, monkeypatch):
    """The same runs, read as a study (arms) and by scripts/compare_runs.py (groups by pattern, the
    baseline first): the same per-seed steps, speedups, intervals, differences and verdicts."""
    from ancre_dit.studies.report import write_study_report
    from ancre_dit.studies.status import RunStatus

    monkeypatch.setattr("ancre_dit.figures.plot_panels", lambda *args, **kwargs: None)  # numbers only
    study = load_study(write_study(tmp_path / "same.yaml", seeds=[0, 1, 2]))
    rates = {"cascaded": [1.0, 1.1, 0.9], "ancre-tau0.1": [1.6, 2.1, 1.8]}  # ancre gets there ~twice as fast
    for job in study.jobs:
        rate = rates[job.arm][job.seed]
        (job.run_dir / "logs").mkdir(parents=True)
        (job.run_dir / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": job.seed, "global_batch_size": 4}}))
        (job.run_dir / "logs" / "evals.jsonl").write_text("".join(json.dumps(
            {"step": s, "settings": {}, "metrics": {"heldout_loss": 1 / (1 + rate * s / 100),
                                                    "digits_acc/cfg2": min(1.0, rate * s / 1000)}}) + "\n"
            for s in range(100, 1100, 100)))
    write_study_report(study, [RunStatus(job, "done", 1000, 1000, None) for job in study.jobs],
                       {arm: 4 for arm in study.arms})
    from_study = json.loads((study.report_dir / "summary.json").read_text())["metrics"]

    runs = [str(job.run_dir) for arm in ("cascaded", "ancre-tau0.1") for job in study.jobs if job.arm == arm]
    monkeypatch.setattr("sys.argv", ["compare_runs.py", *runs, "--out", str(tmp_path / "cmp"),
                                     "--group", "cascaded-s*", "--group", "ancre-tau0.1-s*"])
    with pytest.raises(SystemExit) as info:
        run_cli(lambda: sys.exit(load_script(ROOT / "scripts" / "compare_runs.py").main()))
    assert info.value.code == 0, capsys.readouterr().err
    from_compare = json.loads((tmp_path / "cmp" / "summary.json").read_text())

    assert set(from_compare) == set(from_study) == {"heldout_loss", "digits_acc/cfg2"}
    for metric in from_study:
        arm = from_study[metric]["arms"]["ancre-tau0.1"]
        group = {row["group"]: row for row in from_compare[metric]["rows"]}["ancre-tau0.1-s*"]
        assert arm["speedup"]["low"] is not None and arm["speedup"]["low"] > 1  # an interval, above 1
        for key in ("speedup", "difference", "final", "verdict", "seeds"):
            assert group[key] == arm[key], (metric, key)
        assert arm["verdict"].startswith("faster by ")
