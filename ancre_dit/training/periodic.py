"""The periodic work of a training run, as tasks the loop runs when due: EMA sample grids, the
evaluation (evals.jsonl), checkpoints (with the topology snapshot). Each task reads what it needs
from the trainer and never draws from the training random streams.

The loop calls, after every optimizer step, `task.maybe_run(trainer)` for each task in order, and
`task.finish(trainer, stopped)` once at the end.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import UserError
from ..models import TopologyNotDefined, save_topology_json
from . import checkpointing as ckpt

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import Trainer

QUALITY_PLOT = "quality.png"


class PeriodicTask:
    """Runs every `every` steps (0 = never); `seconds` totals the time it took in this process."""
    name = "task"

    def __init__(self, every: int):
        self.every = every
        self.seconds = 0.0

    def due(self, trainer: "Trainer") -> bool:
        return bool(self.every) and trainer.step % self.every == 0

    def maybe_run(self, trainer: "Trainer") -> None:
        if self.due(trainer):
            start = time.perf_counter()
            self.run(trainer)
            self.seconds += time.perf_counter() - start

    def run(self, trainer: "Trainer") -> None:
        raise NotImplementedError

    def finish(self, trainer: "Trainer", stopped: bool) -> None:
        """Work owed at the end of the loop (default: none)."""


def _decoder(trainer: "Trainer"):
    from ..sampling.decode import build_decoder, decode_pixels
    d = trainer.data
    if d.kind != "latents":
        return decode_pixels
    return build_decoder(trainer.data_spec(), d.in_channels, device=trainer.accelerator.device)


def _devices(trainer: "Trainer") -> list:
    return [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []


class SampleGridTask(PeriodicTask):
    """An EMA sample grid (main process only) to RUN/samples/<step>.png."""
    name = "sample grids"

    def __init__(self, every: int):
        super().__init__(every)
        self._decoder = None
        self._disabled = False

    def due(self, trainer: "Trainer") -> bool:
        return super().due(trainer) and trainer.accelerator.is_main_process and not self._disabled

    def run(self, trainer: "Trainer") -> Path | None:
        from ..figures import save_image_grid
        from ..sampling.api import sample_images
        from ..sampling.guidance import Guidance

        c, d = trainer.config.train, trainer.data
        if self._decoder is None:
            try:
                self._decoder = _decoder(trainer)
            except UserError as err:
                trainer.log.warning("no sample grids: %s", err)
                self._disabled = True
                return None
        n = c.num_sample_images
        labels = (np.arange(n) % d.num_classes if d.num_classes <= 32
                  else np.random.default_rng(c.seed).integers(0, d.num_classes, n))
        cfg = c.cfg_scale_for_grids if trainer.config.model.class_dropout > 0 else 1.0
        with torch.random.fork_rng(devices=_devices(trainer)):
            images = sample_images(trainer.ema.module, trainer.objective, labels, decoder=self._decoder, seed=c.seed,
                                   steps=c.sample_steps, guidance=Guidance(cfg))
        nrow = d.num_classes if d.num_classes <= 32 and n % d.num_classes == 0 else int(math.ceil(math.sqrt(n)))
        path = save_image_grid(images, trainer.run_dir / "samples" / f"{ckpt.step_name(trainer.step)}.png", nrow=nrow)
        trainer.log.info("step %d: EMA sample grid (cfg %.1f) saved to %s", trainer.step, cfg, path)
        return path


class EvaluationTask(PeriodicTask):
    """Every train.eval_every steps and at the end: the evaluation of evaluator.py on all processes,
    appended to RUN/logs/evals.jsonl, TensorBoard and the text log; RUN/quality.png redrawn."""
    name = "evaluation"

    def __init__(self, trainer: "Trainer"):
        from ..evaluation.evaluator import Evaluator, evaluated_steps, resolve_metrics
        from ..evaluation.heldout import build_heldout_set

        super().__init__(trainer.config.train.eval_every)
        e, d = trainer.config.eval, trainer.data
        heldout = None
        if e.heldout_loss and d.heldout is not None:
            heldout = build_heldout_set(d.heldout, d.kind, max_examples=e.heldout_max, draws=e.heldout_draws,
                                        seed=e.seed, objective=trainer.objective)
        needs_decoder = bool(resolve_metrics(e, d.kind))  # only sample metrics decode images
        self.evaluator = Evaluator(e, data_kind=d.kind, num_classes=d.num_classes, objective=trainer.objective,
                                   heldout=heldout,
                                   decoder=_decoder(trainer) if needs_decoder else None,
                                   state=trainer.accelerator, log=trainer.log.info)
        # Read once, before anyone writes: every process then agrees on what is left to do.
        self.done = evaluated_steps(trainer.run_dir, self.evaluator.identity)

    def due(self, trainer: "Trainer") -> bool:
        return super().due(trainer) and trainer.step not in self.done

    def run(self, trainer: "Trainer") -> dict[str, Any] | None:
        from ..evaluation.evaluator import append_eval, format_eval

        result = self.evaluator.evaluate(trainer.ema.module, raw_model=trainer.raw_model)
        self.done.add(trainer.step)
        if result is None:
            return None
        entry = {"step": trainer.step, "images_seen": trainer.step * trainer.config.train.global_batch_size,
                 "train_seconds": round(trainer.train_seconds, 3), "source": "train", **result,
                 "settings": self.evaluator.identity}
        append_eval(trainer.run_dir, entry)
        trainer.log.info(format_eval(entry))
        trainer.accelerator.log({f"eval/{k}": v for k, v in entry["metrics"].items()}, step=trainer.step)
        return entry

    def finish(self, trainer: "Trainer", stopped: bool) -> None:
        start = time.perf_counter()
        if not stopped and trainer.step == trainer.config.train.max_steps and trainer.step not in self.done:
            self.run(trainer)
        if trainer.accelerator.is_main_process:  # drawn once at the end: matplotlib costs seconds per figure
            from ..evaluation.evaluator import read_evals
            mine = [e for e in read_evals(trainer.run_dir) if e.get("settings") == self.evaluator.identity]
            plot_quality(mine, trainer.run_dir / QUALITY_PLOT)
        self.seconds += time.perf_counter() - start


class CheckpointTask(PeriodicTask):
    """A checkpoint every train.ckpt_every steps and at the end (collective)."""
    name = "checkpoints"

    def run(self, trainer: "Trainer") -> None:
        trainer.save()

    def finish(self, trainer: "Trainer", stopped: bool) -> None:
        if trainer.last_saved != trainer.step:
            start = time.perf_counter()
            trainer.save()
            self.seconds += time.perf_counter() - start


def build_tasks(trainer: "Trainer") -> list[PeriodicTask]:
    """In the order they run at a step: grid, evaluation, checkpoint (so a checkpoint follows its evaluation)."""
    c = trainer.config.train
    tasks: list[PeriodicTask] = [SampleGridTask(c.sample_every)]
    if c.eval_every:
        tasks.append(EvaluationTask(trainer))
    tasks.append(CheckpointTask(c.ckpt_every))
    return tasks


def write_topology_files(folder: Path, run_dir: Path, ema_model: torch.nn.Module, raw_model: torch.nn.Module,
                         step: int, topology: str) -> None:
    """The topology snapshot (EMA matrix as JSON + heatmap) into a checkpoint folder and the run dir;
    nothing for n-stream schemes (HC, mHC) that have no block-to-block matrix."""
    P, P_raw = topology_matrix(ema_model), topology_matrix(raw_model)
    if P is None:
        return
    extra = {"step": step, "topology": topology, "weights": "ema", "training_probabilities": P_raw.tolist()}
    for target in (folder, run_dir):
        save_topology_json(target / "topology.json", P, **extra)
    from ..figures import plot_topology_heatmap
    title = f"{topology} topology (EMA), step {step}"
    for target in (folder, run_dir):
        plot_topology_heatmap(P, target / "topology.png", title=title)


def topology_matrix(model: torch.nn.Module) -> torch.Tensor | None:
    """The model's (K, K) topology on the CPU, or None for schemes that have none (HC, mHC)."""
    try:
        return model.topology.probabilities().detach().float().cpu()
    except TopologyNotDefined:
        return None


def plot_quality(entries: list[dict[str, Any]], path: Path) -> Path | None:
    """The run's quality-versus-step curve: held-out loss and every sample metric, one panel each
    (the loss's parts, mse / vb, stay in evals.jsonl)."""
    from ..figures import plot_panels
    series: dict[str, tuple[list, list]] = {}
    for e in sorted(entries, key=lambda e: e["step"]):
        for k, v in e["metrics"].items():
            if k.startswith(("heldout_mse", "heldout_vb")):
                continue
            steps, values = series.setdefault(k, ([], []))
            steps.append(e["step"])
            values.append(v)
    if not series:
        return None
    panels = {k: {"": (np.asarray(steps), np.asarray(values), None)} for k, (steps, values) in series.items()}
    return plot_panels(panels, path, xlabel="step", title="evaluation (digits_*: digits metric, not FID)")
