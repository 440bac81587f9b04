"""benchmarks/gpu_check.py runs end to end on the CPU in its smoke mode, so it cannot rot; its FLOP count
matches the DiT paper's, and one failing item does not cost the others."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ancre_dit.cli import run_cli
from ancre_dit.models import create_model
from benchmarks import gpu_check, gpu_check_plan, gpu_check_trainer
from helpers import ROOT, subprocess_env


def test_refuses_to_measure_a_gpu_on_the_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: gpu_check.main(["--out", str(tmp_path), "--device", "cpu"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--smoke" in err and "Traceback" not in err


HEADLINE = ["host syncs per step", "train DiT-B/2 cascaded compiled", "train DiT-B/2 ancre compiled",
            "train DiT-B/2 ancre:topology_topk=2 compiled", "train DiT-B/2 ancre:history_dtype=bfloat16 compiled",
            "train DiT-B/2 cascaded eager", "train DiT-B/2 ancre eager"]


def _fake_items(monkeypatch, tmp_path, seen_on_disk: dict, slow_item: str | None = None) -> None:
    """Every measurement replaced by an instant fake; eager hc fails, sampling fails after reading the
    report so far, `slow_item` sleeps 3 s."""
    import time

    from benchmarks import gpu_check_syncs

    def fake_training(name, overrides, topology, compiled, cfg, device):
        if topology == "hc" and not compiled:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")
        if slow_item == f"train {name} {topology} {'compiled' if compiled else 'eager'}":
            time.sleep(3)
        return {"model": name, "topology": topology, "compile": compiled, "batch": 2, "step_ms": 10.0,
                "images_per_s": 200.0, "peak_memory_bytes": None, "flops_per_step": 1e9, "warmup_and_compile_s": 0.1}

    def fake_sampling(name, overrides, sampler, steps, compiled, cfg, device):
        if not seen_on_disk:  # the first sampling item
            seen_on_disk.update(json.loads((tmp_path / "gpu_check.json").read_text()))
        raise ValueError("sampler broke")

    monkeypatch.setattr(gpu_check, "training_run", fake_training)
    monkeypatch.setattr(gpu_check_syncs, "host_syncs_run", lambda cfg: [
        {"recipe": "dit-s2-ancre", "counted": True, "quiet_steps": [2, 3, 5], "syncs_per_quiet_step": [0, 0, 0],
         "syncs_at_log_steps": [3, 3], "where_quiet": []}])
    monkeypatch.setattr(gpu_check, "loader_run", lambda cfg: {"images_per_s": 5.0, "workers": 1, "batch": 4,
                                                               "shards": 6, "in_memory_0_workers_images_per_s": 9.0})
    monkeypatch.setattr(gpu_check, "sampling_run", fake_sampling)
    monkeypatch.setattr(gpu_check, "pipeline_run", lambda cfg, device, n, env, deadline: [
        {"stage": "train, SIGTERM to python at step 3", "seconds": 2.0, "result": "checkpoint at step 3"}])
    monkeypatch.setattr(gpu_check, "trainer_run", lambda m, topo, cfg, device, n, deadline: {
        "processes": n, "batch_per_process": 4, "compile": False, "images_per_s_total": 50.0, "images_per_s_per_process": 50.0,
        "mfu": 0.3 if m == "dit-b2" else None, "wall_s": 1.0})
    monkeypatch.setattr(gpu_check, "inception_run", lambda cfg, device: {"images_per_s": 3.0, "batch": 2,
                                                                          "image_size": 64, "weights": "random"})


def test_a_failing_item_is_recorded_and_the_files_are_written_after_every_item(tmp_path, monkeypatch):
    """GPU time is costly: one broken measurement must not lose the others, and a run killed at a
    time limit must leave the report so far on disk. The headline items run first."""
    seen_on_disk: dict = {}
    _fake_items(monkeypatch, tmp_path, seen_on_disk)
    gpu_check.main(["--smoke", "--out", str(tmp_path)])

    # on disk when the first sampling item ran: the headline training items, in their order
    assert [it["name"] for it in seen_on_disk["items"]] == HEADLINE
    assert seen_on_disk["host_syncs"][0]["syncs_per_quiet_step"] == [0, 0, 0]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [it["name"] for it in report["items"]]
    assert names[:len(HEADLINE) + 2] == [*HEADLINE, "sampling DiT-B/2 ddpm-3", "train.py dit-b2-ancre"]
    assert names.index("loader") > names.index("train DiT-S/2 mhc eager")
    assert names[-4:] == [f"train DiT-B/2 {v} compiled" for v in gpu_check.NEWER_VARIANTS]  # last
    hc = next(r for r in report["training"] if r["topology"] == "hc" and not r["compile"])
    assert hc["failed"] == "RuntimeError: CUDA out of memory." and "step_ms" not in hc
    assert {it["name"]: it["status"] for it in report["items"]}["train DiT-S/2 hc eager"] == "failed"
    assert all(r["step_ms"] == 10.0 for r in report["training"] if "failed" not in r)
    assert report["sampling"][0] == {"model": "DiT-B/2", "sampler": "ddpm", "steps": 3, "compile": False,
                                     "failed": "ValueError: sampler broke"}
    assert report["inception"]["images_per_s"] == 3.0 and report["loader"]["images_per_s"] == 5.0
    assert (report["trainer"]["mfu"], report["trainer"]["mfu_from"]) == (0.3, "dit-b2 ancre")
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| dit-b2-ancre | 1 | 4 | False | 50.0 | 50.0 | 30.0% | 1 |" in text
    assert "| DiT-S/2 | hc | False | FAILED: RuntimeError: CUDA out of memory. |" in text
    assert "- sampling DiT-B/2 ddpm-3: FAILED: ValueError: sampler broke" in text
    assert "| dit-s2-ancre | 2, 3, 5 | 0, 0, 0 | 3, 3 | - |" in text
    assert "| host syncs per step * | ok |" in text
    assert not list(tmp_path.glob("*.tmp"))


def test_an_item_past_its_limit_is_cut_and_the_run_goes_on(tmp_path, monkeypatch):
    _fake_items(monkeypatch, tmp_path, {}, slow_item="train DiT-B/2 ancre compiled")
    monkeypatch.setattr(gpu_check, "SMOKE_LIMIT_S", 1.0)
    started = time.monotonic()
    gpu_check.main(["--smoke", "--out", str(tmp_path), "--only", "train DiT-B/2"])
    assert time.monotonic() - started < 3  # the 3 s item was cut at its 1 s limit
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {it["name"]: it["status"] for it in report["items"]}
    assert status["train DiT-B/2 ancre compiled"] == "cut"
    assert status["train DiT-B/2 ancre:topology_topk=2 compiled"] == "ok"  # the next item ran
    assert all(name.startswith("train DiT-B/2") for name in status)  # --only
    cut = next(r for r in report["training"] if r["topology"] == "ancre" and r["compile"])
    assert cut["cut"] == "ran past its limit of 1 s"
    assert "CUT: ran past its limit of 1 s" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_a_child_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """A launcher's workers are its children: the whole process group goes."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(gpu_check_plan.ItemCut, match="launcher ran past its limit of 2 s"):
        gpu_check_plan.run_child([sys.executable, "-c", script], gpu_check_plan.Deadline(2.0), "launcher")
    assert time.monotonic() - started < 10
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived the cut")
    done = gpu_check_plan.run_child([sys.executable, "-c", "print('hi')"], gpu_check_plan.Deadline(30), "quick")
    assert (done.returncode, done.stdout) == (0, "hi\n")


def test_the_plan_needs_no_gpu_and_puts_every_headline_item_in_the_default_budget(capsys):
    gpu_check.main(["--plan"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    headline = [r for r in rows if "*" in r]
    assert len(headline) == 12 and [int(r[0]) for r in headline] == list(range(1, 13))  # first
    assert all(r[-1] == "yes" for r in headline)
    assert "the headline items" in out and "all in budget" in out
    assert "train.py dit-b2-ancre" in out and "sampling DiT-B/2 ddpm-250 compiled" in out
    assert "train DiT-B/2 ancre:aggregation_kernel=triton eager" in out  # the kernels' device is assumed
    gpu_check.main(["--plan", "--budget-s", "60", "--only", "train DiT-B/2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:3].strip().isdigit()]
    assert all(r[1] == "train" and r[2] == "DiT-B/2" for r in rows)
    fits = [r[-1] for r in rows]
    assert fits[:2] == ["yes", "NO"]  # cascaded (29 s) fits in 60 s, ancre (52 s) then does not


def test_the_plan_rows_follow_the_estimates():
    items = [gpu_check_plan.Item(name, None, None, headline=name == "a") for name in ("a", "b", "c", "d")]
    estimates = {"a": gpu_check_plan.Estimate(30, "measured"), "b": gpu_check_plan.Estimate(50, "guess"),
                 "c": gpu_check_plan.Estimate(15, "measured")}
    rows = gpu_check_plan.plan_rows(items, estimates, budget_s=100)
    assert [(r["fits"], r["starts_at_s"]) for r in rows] == [(True, 0), (True, 30), (True, 80), (False, None)]
    assert rows[3]["estimate_s"] == gpu_check_plan.NO_ESTIMATE_S and rows[3]["source"] == "none"


def test_an_unknown_only_name_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: gpu_check.main(["--plan", "--only", "nothing-like-this"]))
    assert exit_info.value.code == 2 and "--plan lists their names" in capsys.readouterr().err.replace("`", "")


@pytest.mark.slow
def test_smoke_run_through_the_device_wrapper_writes_every_measurement(tmp_path):
    """benchmarks/gpu_check_device.sh is the command for a GPU machine without network (nothing
    installed there): here it runs gpu_check --smoke through PYTHONPATH, with no wheels folder, and
    leaves the three files."""
    env = {**subprocess_env(), "ANCRE_WHEELS": str(tmp_path / "no-wheels")}
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check_device.sh"), str(out), "--smoke"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "gpu_check.log").read_text()
    assert log.startswith("torch ") and "train DiT-S/2 mhc eager: " in log and "wrote " in log
    report = json.loads((out / "gpu_check.json").read_text())
    assert all(it["status"] == "ok" for it in report["items"]), [it for it in report["items"] if it["status"] != "ok"]
    eager = [(r["model"], r["topology"]) for r in report["training"] if not r["compile"]]
    assert eager == [("DiT-B/2", "cascaded"), ("DiT-B/2", "ancre"), *[("DiT-S/2", t) for t in gpu_check.TOPOLOGIES],
                     *[("DiT-B/2", t) for t in gpu_check.TOPOLOGIES[2:]]]
    for r in report["training"]:
        assert r["step_ms"] > 0 and r["flops_per_step"] > 0 and r["time_ratio"] > 0
    assert all(r["time_ratio"] == 1.0 for r in report["training"] if r["topology"] == "cascaded")
    compiled = [(r["model"], r["topology"]) for r in report["training"] if r["compile"]]
    assert compiled == [("DiT-B/2", t) for t in ("cascaded", "ancre", *gpu_check.ANCRE_VARIANTS)] + [
        ("DiT-S/2", "cascaded"), ("DiT-S/2", "ancre"), *[("DiT-B/2", v) for v in gpu_check.NEWER_VARIANTS]]
    assert report["loader"]["images_per_s"] > 0 and report["loader"]["in_memory_0_workers_images_per_s"] > 0
    assert [(r["model"], r["sampler"], r["cfg_scale"], r["precision"]) for r in report["sampling"]] == [
        ("DiT-B/2", "ddpm", 1.5, "bf16"), ("DiT-B/2", "dpm-solver", 1.5, "bf16"), ("DiT-S/2", "ddpm", 1.5, "bf16"),
        ("DiT-S/2", "dpm-solver", 1.5, "bf16")]  # the GPU run's path, through CPU autocast
    assert all(r["images_per_s"] > 0 for r in report["sampling"])
    assert report["inception"]["images_per_s"] > 0
    # the trainer's own steps ran; a CPU has no sync debug mode to count with
    assert [(r["recipe"], r["counted"], r["quiet_steps"]) for r in report["host_syncs"]] == [
        ("dit-s2-ancre", False, [2, 3, 5]), ("dit-s2-ancre top-2", False, [2, 3, 5])]
    # train.py itself, through accelerate launch on synthetic latents, read back from its metrics.jsonl
    (run,) = report["trainer"]["runs"]
    assert (run["model"], run["processes"], run["steps"], run["mixed_precision"]) == ("dit-b2", 1, 6, "bf16")
    assert run["images_per_s_total"] > 0 and run["log_lines"] == 3
    assert run["images_per_s_per_process"] > 0 and 0 < run["mfu"] < 1 and report["trainer"]["mfu"] == run["mfu"]
    # a user's path: SIGTERM once 3 steps are logged (no step limit in reach) -> a checkpoint, resumed
    # for 3 more steps, sampled, evaluated
    stages = report["pipeline"]
    assert [r["stage"].split(" at step")[0] for r in stages] == [
        "train, SIGTERM to python", "train --resume auto", "sample.py ddpm-250, 2 images",
        "sample.py dpm-solver-2, 2 images", "evaluate.py fid,is (random Inception weights)"]
    signalled = int(stages[0]["stage"].split(" at step ")[1])
    stopped = int(stages[0]["result"].split("checkpoint at step ")[1].split()[0])
    assert 3 <= signalled <= stopped and stages[1]["result"] == f"step {stopped} -> {stopped + 3}"
    assert "fid " in stages[4]["result"]
    text = (out / "gpu_check.md").read_text()
    assert "| DiT-S/2 | mhc | False |" in text and "no verdict" in text
    assert "| train --resume auto |" in text


def test_training_flops_match_the_dit_papers_count_attention_included():
    """MFU's numerator: DiT-S/2 at 256 px is 6.06 G multiply-adds a forward (DiT paper, Table 1), so
    a training image costs 3 x 2 x 6.06 = 36.4 GFLOP. Without the attention products (what the
    counter sees of SDPA's fused CPU kernel) it would be 32.7."""
    torch.manual_seed(0)
    model = create_model("DiT-S/2", input_size=32, in_channels=4, num_classes=1000).train()
    x, t, y = torch.randn(1, 4, 32, 32), torch.tensor([500]), torch.tensor([3])
    flops = gpu_check.count_training_flops(model, x, t, y, autocast_dtype=None)  # bf16 on this CPU: 13x slower
    assert flops == pytest.approx(3 * 2 * 6.06e9, rel=0.01)
    assert all(p.grad is None for p in model.parameters())


def test_an_item_meant_to_be_compiled_that_did_not_compile_fails():
    """After dynamo's recompile limit a "compiled" model runs eager without a word: the check resets
    dynamo before each item and refuses a compiled item that compiled no graph."""
    gpu_check.fresh_dynamo()
    with pytest.raises(RuntimeError, match="meant to run compiled but dynamo compiled no graph"):
        gpu_check.check_compiled("DiT-S/2 ancre")
    torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(3))
    assert gpu_check.check_compiled("tiny") == 1
    gpu_check.fresh_dynamo()
    with pytest.raises(RuntimeError):
        gpu_check.check_compiled("after a reset")


def test_trainer_metrics_are_medians_after_the_first_log_line(tmp_path):
    # the first two lines under the names of older logs (images_per_sec: all processes), still read
    lines = [{"step": 50, "images_per_sec": 10.0}, {"step": 100, "images_per_sec": 300.0, "mfu": 0.41},
             {"step": 150, "images_per_s_total": 320.0, "mfu": 0.43},
             {"step": 200, "images_per_s_total": 310.0, "mfu": 0.42}]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = gpu_check_trainer.read_trainer_metrics(tmp_path)
    assert (got["steps"], got["log_lines_used"], got["images_per_s_total"], got["mfu"],
            got["images_per_s_per_process"]) == (200, 3, 310.0, 0.42, None)
