"""The periodic work of a training run, as tasks the loop runs when due: EMA sample grids, depth
diagnostics, the evaluation, sparsifying the topology, post-hoc EMA snapshots, checkpoints.

Tasks see a `RunContext`, the slice of the run they may use (never the trainer), and never draw from
the training random streams. The loop calls `task.start(ctx)` once, `task.maybe_run(ctx)` after every
optimizer step, and `task.end(ctx, stopped)` (its `finish`, timed) once at the end.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from . import checkpointing as ckpt
from .config import Config
from .data import DataInfo


@dataclass
class TrainProgress:
    """Where the run stands; the trainer advances it, the tasks read it."""
    step: int = 0
    epoch: int = 0              # the data position: the epoch and the global sample offset in it
    offset: int = 0
    train_seconds: float = 0.0  # time inside optimizer steps, summed over resumes (periodic work excluded)
    last_saved: int = -1        # step of the newest checkpoint written or resumed from in this launch


@dataclass
class RunContext:
    """What the checkpoints, the metrics and the periodic tasks may use of the run they serve."""
    run_dir: Path
    config: Config
    accelerator: Any                # accelerate.Accelerator (process index, device, logging to trackers)
    data: DataInfo
    objective: Any                  # ancre_dit.diffusion.Objective
    raw_model: torch.nn.Module
    emas: dict[str, Any]            # every training.ema.EMA by its weights file's name; "ema" is sampling's
    log: logging.Logger
    progress: TrainProgress = field(default_factory=TrainProgress)
    save: Callable[[], Path] | None = None  # writes a checkpoint of the current step (collective)
    stop_requested: Callable[[], bool] = lambda: False  # a stop signal arrived (agreed by all processes)

    @property
    def ema_model(self) -> torch.nn.Module:
        return self.emas["ema"].module

    @cached_property
    def decoder(self):
        """Samples -> uint8 images (the run's VAE, loaded once and shared by grids and evaluation)."""
        from ..sampling.api import build_decoder
        return build_decoder(ckpt.data_spec(self.data), self.data.in_channels, device=self.accelerator.device)


class PeriodicTask:
    """Runs every `every` steps (0 = never); `seconds` totals the time it took in this process."""
    name = "task"

    def __init__(self, every: int):
        self.every = every
        self.seconds = 0.0

    def due(self, ctx: RunContext) -> bool:
        return bool(self.every) and ctx.progress.step % self.every == 0

    def maybe_run(self, ctx: RunContext) -> None:
        if self.due(ctx):
            start = time.perf_counter()
            self.run(ctx)
            self.seconds += time.perf_counter() - start

    def end(self, ctx: RunContext, stopped: bool) -> None:
        start = time.perf_counter()
        self.finish(ctx, stopped)
        self.seconds += time.perf_counter() - start

    def run(self, ctx: RunContext) -> None:
        raise NotImplementedError

    def start(self, ctx: RunContext) -> None:
        """Work owed before the first step of this launch."""

    def finish(self, ctx: RunContext, stopped: bool) -> None:
        """Work owed at the end of the loop."""


class SampleGridTask(PeriodicTask):
    """An EMA sample grid (main process only) to RUN/samples/<step>.png."""
    name = "sample grids"
    _disabled = False  # not `every = 0`: the base rule of `due` must stay the same on every rank

    def due(self, ctx: RunContext) -> bool:
        return super().due(ctx) and ctx.accelerator.is_main_process and not self._disabled

    def run(self, ctx: RunContext) -> Path | None:
        from ..figures import save_image_grid
        from ..sampling.api import sample_images
        from ..sampling.guidance import Guidance

        c, d, step = ctx.config.train, ctx.data, ctx.progress.step
        try:
            decoder = ctx.decoder
        except UserError as err:  # e.g. a latent run without a VAE at hand: grids off, training goes on
            ctx.log.warning("no sample grids: %s", err)
            self._disabled = True
            return None
        n = c.num_sample_images
        labels = (np.arange(n) % d.num_classes if d.num_classes <= 32
                  else np.random.default_rng(c.seed).integers(0, d.num_classes, n))
        cfg = c.cfg_scale_for_grids if ctx.config.model.class_dropout > 0 else 1.0
        devices = [ctx.accelerator.device] if ctx.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            images = sample_images(ctx.ema_model, ctx.objective, labels, decoder=decoder, seed=c.seed,
                                   steps=c.sample_steps, guidance=Guidance(cfg))
        nrow = d.num_classes if d.num_classes <= 32 and n % d.num_classes == 0 else int(math.ceil(math.sqrt(n)))
        path = save_image_grid(images, ctx.run_dir / "samples" / f"{ckpt.step_name(step)}.png", nrow=nrow)
        ctx.log.info("step %d: EMA sample grid (cfg %.1f) saved to %s", step, cfg, path)
        return path


class EvaluationTask(PeriodicTask):
    """Every train.eval_every steps and at the end, on all processes: the run's evaluation
    (run_evaluation.py) to RUN/logs/evals.jsonl, the trackers and the log; RUN/quality.png at the end."""
    name = "evaluation"

    def __init__(self, ctx: RunContext):
        from ..evaluation.evaluator import resolve_metrics
        from .run_evaluation import agree_on_evaluated, build_run_evaluator

        super().__init__(ctx.config.train.eval_every)
        needs_decoder = bool(resolve_metrics(ctx.config.eval, ctx.data.kind))  # only sample metrics decode images
        self.evaluator = build_run_evaluator(ctx.config, ctx.data, ctx.objective,
                                             decoder=ctx.decoder if needs_decoder else None, state=ctx.accelerator)
        # Read once, before anyone writes, by one process for all.
        self.done = agree_on_evaluated(ctx.accelerator, ctx.run_dir, self.evaluator.identity)

    def due(self, ctx: RunContext) -> bool:
        return super().due(ctx) and ctx.progress.step not in self.done

    def start(self, ctx: RunContext) -> None:
        """A resumed step that is due but unevaluated (a stop abandoned it) is evaluated first."""
        if ctx.progress.step and self.due(ctx):
            ctx.log.info("step %d: the evaluation a stop abandoned runs now", ctx.progress.step)
            self.maybe_run(ctx)

    def run(self, ctx: RunContext) -> dict[str, Any] | None:
        from ..evaluation.evaluator import EvaluationAbandoned
        from .run_evaluation import evaluate_emas, record_evaluation

        step = ctx.progress.step
        try:
            models = {name: ema.module for name, ema in ctx.emas.items()}
            result = evaluate_emas(self.evaluator, models, ctx.raw_model, should_stop=ctx.stop_requested)
        except EvaluationAbandoned:
            ctx.log.info("step %d: stop requested during the evaluation: abandoned, it runs again on resume", step)
            return None
        self.done.add(step)
        if result is None:  # not the main process
            return None
        return record_evaluation(ctx.run_dir, result, self.evaluator.identity, step=step,
                                 images_seen=step * ctx.config.train.global_batch_size,
                                 train_seconds=round(ctx.progress.train_seconds, 3), source="train",
                                 log=ctx.log.info, tracker=ctx.accelerator)

    def finish(self, ctx: RunContext, stopped: bool) -> None:
        from .run_evaluation import plot_run_quality

        step = ctx.progress.step
        if not stopped and step == ctx.config.train.max_steps and step not in self.done:
            self.run(ctx)
        if ctx.accelerator.is_main_process and ctx.config.log.figures:  # once: matplotlib takes seconds a figure
            plot_run_quality(ctx.run_dir, self.evaluator.identity)


DIAGNOSTICS_FILE = "diagnostics.jsonl"


class DiagnosticsTask(PeriodicTask):
    """Every train.log_every steps (main process): the raw model's depth diagnostics on a fixed probe batch
    and the routing's, to RUN/logs/diagnostics.jsonl and the trackers; RUN/diagnostics.png at the end."""
    name = "diagnostics"
    PROBE_SIZE = 16

    def __init__(self, ctx: RunContext):
        from ..evaluation.diagnostics import RoutingWatch

        super().__init__(ctx.config.train.log_every if ctx.config.train.diagnostics else 0)
        self.watch = RoutingWatch()
        self.probe = None

    def due(self, ctx: RunContext) -> bool:
        return super().due(ctx) and ctx.accelerator.is_main_process

    def run(self, ctx: RunContext) -> dict[str, Any]:
        from ..evaluation.diagnostics import depth_profile
        from ..evaluation.evaluator import build_heldout_set
        from ..files import append_jsonl

        d, device, step = ctx.data, ctx.accelerator.device, ctx.progress.step
        if self.probe is None:
            held = build_heldout_set(d.heldout if d.heldout is not None else d.dataset, d.kind,
                                     max_examples=self.PROBE_SIZE, draws=1, seed=ctx.config.train.seed,
                                     objective=ctx.objective)
            self.probe = [v.to(device) for v in (held.x, held.y, held.t, held.noise)]
        x, y, t, noise = self.probe
        record = {"step": step, **depth_profile(ctx.raw_model, ctx.objective, x, y, (t, noise)),
                  **self.watch.look(ctx.ema_model, ctx.raw_model)}
        append_jsonl(ctx.run_dir / "logs" / DIAGNOSTICS_FILE, record)
        tracked = {f"diagnostics/{name}": value for name, value in record.items()
                   if name != "step" and not isinstance(value, list)}
        for name in ("rms", "grad_rms", "cosine"):
            tracked.update({f"diagnostics/{name}_{k}": v for k, v in enumerate(record[name])})
        ctx.accelerator.log(tracked, step=step)
        return record

    def finish(self, ctx: RunContext, stopped: bool) -> None:
        if self.every and ctx.accelerator.is_main_process and ctx.config.log.figures:
            from ..figures import plot_diagnostics
            from ..files import read_jsonl

            plot_diagnostics(read_jsonl(ctx.run_dir / "logs" / DIAGNOSTICS_FILE), ctx.run_dir / "diagnostics.png")


class SparsifyTopologyTask(PeriodicTask):
    """Sparse ANCRe: at train.topology_sparsify_step each block keeps its model.topology_topk strongest
    incoming edges of the training weights, every EMA the same ones; on every process, first at that step."""
    name = "topology sparsify"

    def __init__(self, step: int):
        super().__init__(0)
        self.step = step

    def due(self, ctx: RunContext) -> bool:
        return ctx.progress.step == self.step

    def start(self, ctx: RunContext) -> None:
        """A run stopped after the switch step but before its tasks ran, switches now."""
        if ctx.progress.step >= self.step and not ctx.raw_model.topology.is_sparse:
            self.run(ctx)

    def run(self, ctx: RunContext) -> None:
        topology = ctx.raw_model.topology
        topology.sparsify()
        for ema in ctx.emas.values():
            ema.module.topology.sparsify(topology.kept)
        ctx.log.info("step %d: topology sparsified: each block keeps its %d strongest incoming edges (%d of %d)",
                     ctx.progress.step, topology.topk, int(topology.kept.sum()),
                     topology.num_blocks * (topology.num_blocks + 1) // 2)


class PhemaSnapshotTask(PeriodicTask):
    """The post-hoc EMAs' snapshot every train.phema.snapshot_every steps (main process): RUN/phema/<step>."""
    name = "post-hoc EMA snapshots"

    def run(self, ctx: RunContext) -> None:
        from .phema import PowerFunctionEMA, write_snapshot

        if ctx.accelerator.is_main_process:  # (due stays the base rule: the guard's report is collective)
            write_snapshot(ctx.run_dir, ctx.progress.step, {ema.std: ema.module.state_dict()
                                                            for ema in ctx.emas.values()
                                                            if isinstance(ema, PowerFunctionEMA)})


class CheckpointTask(PeriodicTask):
    """A checkpoint every train.ckpt_every steps and at the end (collective)."""
    name = "checkpoints"

    def run(self, ctx: RunContext) -> None:
        ctx.save()

    def finish(self, ctx: RunContext, stopped: bool) -> None:
        if ctx.progress.last_saved != ctx.progress.step:
            ctx.save()


def build_tasks(ctx: RunContext) -> list[PeriodicTask]:
    """In the order they run at a step: sparsifying first (the step's other tasks see the sparse
    topology), a checkpoint after its evaluation."""
    c = ctx.config.train
    tasks: list[PeriodicTask] = [SampleGridTask(c.sample_every), DiagnosticsTask(ctx)]
    if c.topology_sparsify_step:
        tasks.insert(0, SparsifyTopologyTask(c.topology_sparsify_step))
    if c.eval_every:
        tasks.append(EvaluationTask(ctx))
    if c.phema.stds:
        tasks.append(PhemaSnapshotTask(c.phema.snapshot_every))
    tasks.append(CheckpointTask(c.ckpt_every))
    return tasks
