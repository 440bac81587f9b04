"""The GPU check's trainer item: train.py itself, as a user launches it, on synthetic latents, with
the throughput and MFU it logs read back from its metrics.jsonl (gpu_check.json's "trainer")."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_check_plan import Deadline, run_child

ROOT = Path(__file__).resolve().parents[1]


def trainer_command(model: str, topology: str, cfg: dict, data: Path, run_dir: Path, processes: int,
                    device: torch.device, max_steps: int | None = None) -> list[str]:
    """`accelerate launch train.py` as a user runs it: the recipe (bf16, EMA, non-finite guard, the
    latent loader with its workers, compile on a GPU), on synthetic latents, every GPU of the machine."""
    t = cfg["trainer"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
              "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no"]
    launch += ["--multi_gpu"] if processes > 1 else []
    launch += ["--cpu"] if device.type == "cpu" else []
    overrides = [f"run_dir={run_dir}", f"data.path={data}", f"data.image_size={8 * t['side']}",
                 f"data.num_workers={t['workers']}", f"train.max_steps={max_steps or t['steps']}",
                 f"train.global_batch_size={t['batch'] * processes}", f"train.log_every={t['log_every']}",
                 "train.ckpt_every=1000000", "train.sample_every=0", "train.eval_every=0", "train.mixed_precision=bf16",
                 f"train.compile={str(t['compile']).lower()}", "log.tensorboard=false", "log.figures=false",
                 *t["model_overrides"]]
    if device.type == "cpu":  # no peak is known for a CPU: a nominal 1 TFLOP/s, so the smoke run reads an mfu too
        overrides.append("train.peak_tflops=1.0")
    return [*launch, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / f"{model}-{topology}.yaml"), *overrides]


def read_trainer_metrics(run_dir: Path, skip_first: int = 1) -> dict:
    """Throughput from a run's logs/metrics.jsonl: the median over log lines after the first
    `skip_first` (compile and loader start-up), of the keys the trainer logs."""
    from ancre_dit.files import read_jsonl

    rows = read_jsonl(run_dir / "logs" / "metrics.jsonl")
    if not rows:
        raise RuntimeError(f"{run_dir}/logs/metrics.jsonl holds no log line")
    steady = rows[skip_first:] or rows[-1:]
    result: dict = {"steps": rows[-1]["step"], "log_lines": len(rows), "log_lines_used": len(steady)}
    for key in ("images_per_s_total", "images_per_s_per_process", "mfu", "tflops_per_s"):
        old = OLD_METRIC_NAMES.get(key, key)  # logs written before the rename
        values = [r.get(key, r.get(old)) for r in steady if r.get(key, r.get(old)) is not None]
        result[key] = float(np.median(values)) if values else None
    return result


# metrics.jsonl's names before they said what they count: all processes, one process.
OLD_METRIC_NAMES = {"images_per_s_total": "images_per_sec", "images_per_s_per_process": "images_per_s"}


def trainer_run(model: str, topology: str, cfg: dict, device: torch.device, processes: int, deadline: Deadline) -> dict:
    """train.py through accelerate launch on synthetic latents; images/s (and MFU) from its metrics.jsonl.
    The launch, its ranks and their loader workers are killed together at the deadline."""
    from benchmarks import bench_loader

    t = cfg["trainer"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_trainer_") as tmp:
        data = bench_loader.write_synthetic_latents(Path(tmp) / "latents", t["shards"], t["per_shard"],
                                                    (4, t["side"], t["side"]))
        run_dir = Path(tmp) / "run"
        start = time.perf_counter()
        proc = run_child(trainer_command(model, topology, cfg, data, run_dir, processes, device), deadline,
                         "train.py", env=child_env(), cwd=tmp)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise RuntimeError(f"train.py exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        metrics = read_trainer_metrics(run_dir)
    return {"model": model, "topology": topology, "processes": processes, "batch_per_process": t["batch"],
            "compile": t["compile"], "mixed_precision": "bf16", "loader_workers": t["workers"], "wall_s": seconds,
            **metrics}


def child_env() -> dict:
    """This checkout first on the child's path (the check runs from a tree, not an install)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep + path if path else ''}", "PYTHONUNBUFFERED": "1"}


def trainer_summary(rows: list[dict], device_name: str, peak: float | None) -> dict:
    """gpu_check.json's "trainer": every train.py run, and the MFU a study's --dry-run takes (that of
    the largest model measured, ancre preferred)."""
    measured = [r for r in rows if r.get("images_per_s_total")]
    order = {"dit-b2": 2, "dit-s2": 1}
    best = max(measured, key=lambda r: (order.get(r["model"], 0), r["topology"] == "ancre"), default=None)
    return {"device": device_name, "peak_tflops": peak, "runs": rows,
            "mfu": best.get("mfu") if best else None, "mfu_from": f"{best['model']} {best['topology']}" if best else None}
