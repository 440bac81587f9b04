"""scripts/gpu_check.py (issue 15, part 5) runs end to end on the CPU in its smoke mode, so it cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_smoke_run_writes_every_measurement(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=subprocess_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    eager = [r for r in report["training"] if not r["compile"]]
    assert [r["topology"] for r in eager] == ["cascaded", "ancre", "denseformer", "hc", "mhc"]
    for r in eager:
        assert r["step_ms"] > 0 and r["flops_per_step"] > 0 and r["time_ratio"] > 0
    assert eager[0]["time_ratio"] == 1.0
    assert {r["topology"] for r in report["training"] if r["compile"]} == {"cascaded", "ancre"}
    assert all(r["step_ms"] > 0 for r in report["training"])
    assert report["loader"]["images_per_s"] > 0 and report["loader"]["in_memory_0_workers_images_per_s"] > 0
    assert [(r["sampler"], r["cfg_scale"]) for r in report["sampling"]] == [("ddpm", 1.5), ("dpm-solver", 1.5)]
    assert all(r["images_per_s"] > 0 for r in report["sampling"])
    assert report["inception"]["images_per_s"] > 0
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| DiT-S/2 | mhc | False |" in text and "no verdict" in text


@pytest.mark.slow
def test_refuses_to_measure_a_gpu_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu"], capture_output=True,
                          text=True, env=subprocess_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--smoke" in proc.stderr and "Traceback" not in proc.stderr
