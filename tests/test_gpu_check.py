"""benchmarks/gpu_check.py runs end to end on the CPU in its smoke mode, so it cannot rot; its FLOP count
matches the DiT paper's, and one failing item does not cost the others."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ancre_dit.cli import run_cli
from ancre_dit.models import create_model
from benchmarks import gpu_check, gpu_check_trainer
from helpers import ROOT, subprocess_env


def test_refuses_to_measure_a_gpu_on_the_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: gpu_check.main(["--out", str(tmp_path), "--device", "cpu"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--smoke" in err and "Traceback" not in err


def test_a_failing_item_is_recorded_and_the_files_are_written_after_every_item(tmp_path, monkeypatch):
    """GPU time is costly: one broken measurement must not lose the others, and a run killed at a
    time limit must leave the report so far on disk."""

    def fake_training(name, overrides, topology, compiled, cfg, device):
        if topology == "hc" and not compiled:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")
        return {"model": name, "topology": topology, "compile": compiled, "batch": 2, "step_ms": 10.0,
                "images_per_s": 200.0, "peak_memory_bytes": None, "flops_per_step": None if compiled else 1e9,
                "warmup_and_compile_s": 0.1}

    seen_on_disk = {}

    def fake_sampling(name, overrides, cfg, device):  # runs after training and the loader
        seen_on_disk.update(json.loads((tmp_path / "gpu_check.json").read_text()))
        raise ValueError("sampler broke")

    monkeypatch.setattr(gpu_check, "training_run", fake_training)
    monkeypatch.setattr(gpu_check, "loader_run", lambda cfg: {"images_per_s": 5.0, "workers": 1, "batch": 4,
                                                               "shards": 6, "in_memory_0_workers_images_per_s": 9.0})
    monkeypatch.setattr(gpu_check, "sampling_run", fake_sampling)
    monkeypatch.setattr(gpu_check, "pipeline_run", lambda cfg, device, n, env: [
        {"stage": "train, SIGTERM to python at step 3", "seconds": 2.0, "result": "checkpoint at step 3"}])
    monkeypatch.setattr(gpu_check, "trainer_run", lambda m, topo, cfg, device, n: {
        "processes": n, "batch_per_process": 4, "compile": False, "images_per_sec": 50.0, "images_per_s": 50.0,
        "mfu": 0.3 if m == "dit-s2" else None, "wall_s": 1.0})
    monkeypatch.setattr(gpu_check, "inception_run", lambda cfg, device: {"images_per_s": 3.0, "batch": 2,
                                                                          "image_size": 64, "weights": "random"})
    gpu_check.main(["--smoke", "--out", str(tmp_path)])

    # on disk before sampling ran: eager training, then the compiled runs the targets need
    assert [(r["topology"], r["compile"]) for r in seen_on_disk["training"]] == [
        ("cascaded", False), ("ancre", False), ("denseformer", False), ("hc", False), ("mhc", False),
        ("cascaded", True), ("ancre", True), ("ancre:history_dtype=bfloat16", True), ("ancre:topology_topk=1", True)]
    assert seen_on_disk["loader"]["images_per_s"] == 5.0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    hc = next(r for r in report["training"] if r["topology"] == "hc")
    assert hc["failed"] == "RuntimeError: CUDA out of memory." and "step_ms" not in hc
    assert all(r["step_ms"] == 10.0 for r in report["training"] if r["topology"] != "hc")
    assert [r["topology"] for r in report["training"]][-4:] == list(gpu_check.NEWER_VARIANTS)  # after Inception
    assert report["sampling"] == [{"model": "DiT-S/2", "failed": "ValueError: sampler broke"}]
    assert report["inception"]["images_per_s"] == 3.0
    assert seen_on_disk["trainer"]["runs"][0]["images_per_sec"] == 50.0  # train.py runs before sampling
    assert (report["trainer"]["mfu"], report["trainer"]["mfu_from"]) == (0.3, "dit-s2 ancre")
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| dit-s2-ancre | 1 | 4 | False | 50.0 | 50.0 | 30.0% | 1 |" in text
    assert "| DiT-S/2 | hc | False | FAILED: RuntimeError: CUDA out of memory. |" in text
    assert "- sampling DiT-S/2: FAILED: ValueError: sampler broke" in text
    assert not list(tmp_path.glob("*.tmp"))


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
    assert log.startswith("torch ") and "train DiT-S/2 mhc compile=False" in log and "wrote " in log
    report = json.loads((out / "gpu_check.json").read_text())
    eager = [r for r in report["training"] if not r["compile"]]
    assert [r["topology"] for r in eager] == ["cascaded", "ancre", "denseformer", "hc", "mhc"]
    for r in eager:
        assert r["step_ms"] > 0 and r["flops_per_step"] > 0 and r["time_ratio"] > 0
    assert eager[0]["time_ratio"] == 1.0
    compiled = [r["topology"] for r in report["training"] if r["compile"]]
    assert compiled == ["cascaded", "ancre", "ancre:history_dtype=bfloat16", "ancre:topology_topk=1",
                        *gpu_check.NEWER_VARIANTS]  # the newer ones last, with their options
    newer = [r for r in report["training"] if r["topology"] in gpu_check.NEWER_VARIANTS]
    assert all(r["flops_per_step"] > 0 for r in newer)  # no eager run to take the count from: their own (for MFU)
    assert all(r["step_ms"] > 0 and r["time_ratio"] > 0 for r in report["training"])
    assert report["loader"]["images_per_s"] > 0 and report["loader"]["in_memory_0_workers_images_per_s"] > 0
    assert [(r["sampler"], r["cfg_scale"], r["precision"]) for r in report["sampling"]] == [
        ("ddpm", 1.5, "bf16"), ("dpm-solver", 1.5, "bf16")]  # the GPU run's path, through CPU autocast
    assert all(r["images_per_s"] > 0 for r in report["sampling"])
    assert report["inception"]["images_per_s"] > 0
    # train.py itself, through accelerate launch on synthetic latents, read back from its metrics.jsonl
    (run,) = report["trainer"]["runs"]
    assert (run["model"], run["processes"], run["steps"], run["mixed_precision"]) == ("dit-s2", 1, 6, "bf16")
    assert run["images_per_sec"] > 0 and run["log_lines"] == 3
    assert run["images_per_s"] > 0 and 0 < run["mfu"] < 1 and report["trainer"]["mfu"] == run["mfu"]
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
    lines = [{"step": 50, "images_per_sec": 10.0}, {"step": 100, "images_per_sec": 300.0, "mfu": 0.41},
             {"step": 150, "images_per_sec": 320.0, "mfu": 0.43}, {"step": 200, "images_per_sec": 310.0, "mfu": 0.42}]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = gpu_check_trainer.read_trainer_metrics(tmp_path)
    assert (got["steps"], got["log_lines_used"], got["images_per_sec"], got["mfu"], got["images_per_s"]) == \
        (200, 3, 310.0, 0.42, None)
