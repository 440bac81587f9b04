"""The GPU check's host-sync item: the trainer's own steps on a GPU, with
`torch.cuda.set_sync_debug_mode("warn")` reporting every operation that waits for the device, counted
per step. tests/test_host_syncs.py counts the same on a CPU at the dispatcher; this is what a GPU
itself says. A step that logs nothing should count 0."""
from __future__ import annotations

import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The trainer's recipes whose quiet steps are counted: the DiT-S/2 ANCRe config as shipped and its
# sparse top-2 form (switched at step 1); the CPU test covers every other recipe at the dispatcher.
RECIPES = {"dit-s2-ancre": (), "dit-s2-ancre top-2": ("model.topology_topk=2", "train.topology_sparsify_step=1")}
LOG_EVERY, MAX_STEPS = 4, 6
SYNC_WARNING = "synchronizing"


def _reset_accelerate() -> None:
    """AcceleratorState is a process-wide singleton: each in-process trainer starts from none."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def count_recipe(overrides: tuple[str, ...], data: Path, side: int, run_dir: Path, model_overrides: list[str]) -> dict:
    """Syncs per step of a 6-step eager training (the Python aggregation, where a sync could hide)
    that logs at steps 4 and 6; steps 2, 3 and 5 log nothing (step 1 fills the device caches once)."""
    from ancre_dit.training import Trainer
    from ancre_dit.training.config import load_config

    config = load_config(ROOT / "configs" / "dit-s2-ancre.yaml", [
        f"run_dir={run_dir}", f"data.path={data}", f"data.image_size={8 * side}", "data.num_workers=2", f"train.max_steps={MAX_STEPS}",
        f"train.log_every={LOG_EVERY}", "train.ckpt_every=1000000", "train.sample_every=0", "train.eval_every=0",
        "train.global_batch_size=32", "train.compile=false", "train.diagnostics=false", "log.tensorboard=false", "log.figures=false",
        *model_overrides, *overrides])
    by_step: dict[int, list[str]] = defaultdict(list)
    state = {"step": 0, "seen": 0}
    real_step = Trainer.train_step

    def flush(records) -> None:
        """The sync warnings since the last call, to the step that made them."""
        for w in records[state["seen"]:]:
            if SYNC_WARNING in str(w.message):
                by_step[state["step"]].append(f"{Path(w.filename).name}:{w.lineno}")
        state["seen"] = len(records)

    cuda = torch.cuda.is_available()
    _reset_accelerate()
    try:
        trainer = Trainer(config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def step(self, batches):
                # what ran after step k's train_step (its logging, tasks, stop check) is step k's too
                flush(caught)
                state["step"] = self.step + 1
                return real_step(self, batches)

            Trainer.train_step = step
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.run()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            flush(caught)
    finally:
        Trainer.train_step = real_step
        _reset_accelerate()
    quiet = [s for s in range(2, MAX_STEPS + 1) if s % LOG_EVERY and s != MAX_STEPS]
    return {"counted": cuda, "quiet_steps": quiet, "syncs_per_quiet_step": [len(by_step[s]) for s in quiet],
            "syncs_at_log_steps": [len(by_step[s]) for s in (LOG_EVERY, MAX_STEPS)],
            "where_quiet": sorted({w for s in quiet for w in by_step[s]})[:10]}


def host_syncs_run(cfg: dict) -> list[dict]:
    from benchmarks import bench_loader

    c = cfg["host_syncs"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_syncs_") as tmp:
        data = bench_loader.write_synthetic_latents(Path(tmp) / "latents", 2, 64, (4, c["side"], c["side"]))
        for name, overrides in RECIPES.items():
            row = count_recipe(overrides, data, c["side"], Path(tmp) / name.replace(" ", "-"), c["model_overrides"])
            rows.append({"recipe": name, **row})
    return rows
