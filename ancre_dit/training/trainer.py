"""The training loop: DiT's diffusion (or SiT's flow) objective with Accelerate (CPU, one or many GPUs, many nodes).

Read it top-down, as DiT's train.py: `Trainer.__init__` builds the run, `run()` is the loop,
`train_step()` one optimizer step (one global batch = per-device batch x processes x accumulation).
Every random draw is reproducible from saved state: the data order from (seed, epoch), the times, noise,
flips and posterior draws from a per-rank generator in the checkpoints, label dropout from the global
RNG (which Accelerate saves per rank).
"""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from ..errors import UserError
from ..hardware import configure_precision, peak_tflops
from ..diffusion import build_objective
from ..models import create_model
from ..models.flops import flops_per_training_image
from ..models.topologies.analysis import topology_entropy
from . import checkpointing as ckpt
from .config import Config, flat_config, save_config
from .rank_decisions import agree_on_resume
from .ema import EMA, ema_names, ema_update_
from .model_setup import diffusion_spec, model_kwargs, param_groups
from .guards import NonFiniteGuard
from .lr_schedule import lr_at
from .phema import PowerFunctionEMA
from .stopping import StopAgreement, StopSignals
from .periodic import PeriodicTask, RunContext, build_tasks
from .data import (GlobalBatchSampler, advance_position, build_data, check_batch_layout, check_enough_samples,
                   load_latents_in_memory, make_loader, nonfinite_rows, prepare_batch)
from .repa import build_repa
from .run_lock import abandon_new_run_dir, claim_run_dir, release_run_dir
from .run_log import LOG_FILE, METRICS_FILE, MetricsLog, log_time_shares, make_logger, plot_loss


def _seed(*parts: int) -> int:
    """A 32-bit seed mixed from several integers (distinct streams per rank and purpose)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def _make_accelerator(c: Config, run_dir: Path) -> Accelerator:
    trackers = ["tensorboard"] if c.log.tensorboard else []
    if c.log.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("log.wandb=true but wandb is not installed; pip install wandb, "
                            "or set log.wandb=false") from None
        trackers.append("wandb")
    return Accelerator(
        mixed_precision=c.train.mixed_precision,
        gradient_accumulation_steps=c.train.grad_accum,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")),
        # No forward changes a buffer (nothing to broadcast); gradients live in DDP's buckets (no copy).
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True),
                         InitProcessGroupKwargs(timeout=timedelta(seconds=c.train.collective_timeout_s))],
    )


class Trainer:
    """Builds everything from a Config; `run()` trains to train.max_steps (or until a signal)."""

    def __init__(self, config: Config, resume: str | None = None):
        self.config = c = config
        self.run_dir = Path(c.run_dir)

        # Processes, and the run folder claimed before anything is written.
        self.accelerator = acc = _make_accelerator(c, self.run_dir)
        self.micro_batch = check_batch_layout(c, acc.num_processes)
        if resume and resume != "auto":
            ckpt.check_resume_path(resume)  # a wrong path is refused before the folder is claimed
        claim_run_dir(self.run_dir, acc)
        if acc.is_main_process:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        self.log = make_logger(self.run_dir, acc.is_main_process)
        configure_precision(acc.device, c.train.tf32)

        # Same seed on every rank for the model (DDP also broadcasts rank 0's weights), then a
        # distinct seed per rank for everything random during training.
        set_seed(c.train.seed)
        self.data = d = build_data(c)
        check_enough_samples(len(d.dataset), c.train.global_batch_size, c.data.path or c.data.kind)
        if c.data.in_memory and d.latents is not None:
            load_latents_in_memory(d, acc, self.run_dir)
        self.model_kwargs = model_kwargs(c.model, d.input_size, d.in_channels, d.num_classes)  # checked with the config
        self.raw_model = create_model(c.model.name, **self.model_kwargs).to(acc.device).train()
        # Every EMA by the name of its weights file; "ema" (train.ema_decay) is the one sampling reads.
        emas = [EMA(self.raw_model, d, warmup=c.train.ema_warmup) for d in (c.train.ema_decay, *c.train.ema_decays)]
        emas += [PowerFunctionEMA(self.raw_model, s) for s in c.train.phema.stds]
        self.emas = dict(zip(ema_names(c.train), emas))
        self.ema = self.emas["ema"]
        self.raw_model.set_grad_checkpointing(c.train.grad_checkpointing)
        self.objective = build_objective(diffusion_spec(c))
        self.repa = build_repa(c.repa, self.raw_model, d.input_size, acc.device, bf16=c.train.mixed_precision == "bf16",
                               seed=_seed(c.train.seed, 2), log=self.log)  # None with repa.weight 0
        rank = acc.process_index
        set_seed(_seed(c.train.seed, rank, 0))
        self.generator = torch.Generator(device=acc.device).manual_seed(_seed(c.train.seed, rank, 1))

        # Fused AdamW (one kernel, takes the guard's skip mask on the device); routing params grouped apart.
        self.fused = acc.device.type in torch.utils._foreach_utils._get_fused_kernels_supported_devices()
        groups, self.routing_group = param_groups(self.raw_model, c.train.topology_weight_decay,
                                                  self.repa.projector if self.repa is not None else None)
        optimizer = torch.optim.AdamW(groups, lr=c.train.lr, betas=(c.train.adam_beta1, c.train.adam_beta2),
                                      weight_decay=c.train.weight_decay, fused=self.fused or None)
        model = torch.compile(self.raw_model) if c.train.compile else self.raw_model
        # REPA's projector is prepared as a model of its own (its gradients averaged like the model's).
        extra = [self.repa.projector] if self.repa is not None else []
        self.model, *prepared, self.optimizer = acc.prepare(model, *extra, optimizer)
        self.projector = prepared[0] if prepared else None
        self.trained_modules = (self.model, *prepared)

        # Checkpoints and resume (one rank picks the checkpoint, every rank loads it); the tasks share the context.
        self.context = ctx = RunContext(self.run_dir, c, acc, d, self.objective, self.raw_model, self.emas, self.log,
                                        stop_requested=self._stop_requested)
        self.progress = ctx.progress
        self.checkpoints = ckpt.CheckpointManager(ctx, self.model_kwargs, self.repa, self.generator)
        ctx.save = self.checkpoints.save
        resumed_from = agree_on_resume(acc, resume, self.run_dir, warn=self.log.warning)
        if resumed_from is not None:
            self.checkpoints.load(resumed_from, lambda step: _seed(c.train.seed, rank, 1, step))
        elif resume == "auto":
            self.log.info("--resume auto: no complete checkpoint in %s, starting from scratch",
                          ckpt.checkpoints_dir(self.run_dir))
        if acc.is_main_process:
            save_config(c, self.run_dir / "config.yaml")
        acc.init_trackers(c.log.project, config=flat_config(c))

        # What runs beside the steps: the non-finite guard, the stop agreement, metrics, periodic tasks.
        self.guard = NonFiniteGuard(ctx, self.checkpoints.last_good,
                                    bad_rows=partial(nonfinite_rows, d, c.train.global_batch_size, c.train.seed))
        self.stop_agreement = StopAgreement(acc.num_processes, c.train.stop_check_every, c.train.collective_timeout_s)
        self._signals: StopSignals | None = None
        self.flops_per_image = flops_per_training_image(lambda device: create_model(c.model.name, **self.model_kwargs),
                                                        d.in_channels, d.input_size)
        self.peak_tflops, self.peak_source = peak_tflops(acc.device, c.train.peak_tflops)
        self.metrics = MetricsLog(ctx, self.flops_per_image, self.peak_tflops, self.peak_source)
        self.tasks = build_tasks(ctx)

    @property
    def step(self) -> int:
        return self.progress.step

    def run(self) -> dict[str, Any]:
        """Trains to train.max_steps, or until a stop signal; the last step is checkpointed either way."""
        acc, c = self.accelerator, self.config.train
        self._log_start()
        launch_started_at = self.progress.train_seconds
        progress = tqdm(total=c.max_steps, initial=self.step, disable=not acc.is_main_process,
                        desc="train", dynamic_ncols=True)
        self.metrics.start(time.perf_counter())
        # The handlers go in before the loader's workers fork: see stopping.py.
        with StopSignals() as signals:
            self._signals = signals
            batches = iter(self._loader())
            for task in self.tasks:  # work a stopped launch left owed (an abandoned evaluation, ...)
                task.start(self.context)
            stopped = self._stop_requested()  # a stop during that work: checkpoint without another step
            while not stopped and self.step < c.max_steps:
                # 1. One optimizer step; its loss terms stay on the device.
                started = time.perf_counter()
                with self._ends_on_user_error(progress):  # unreadable data: nothing saved over the good checkpoints
                    terms = self.train_step(batches)
                self.progress.train_seconds += time.perf_counter() - started
                self.metrics.add(terms, self.lr)
                progress.update(1)
                # 2. The guard's verdict (collective), at log steps and before any periodic task, so no checkpoint
                # is written before a stop is decided; by the base rule of `due`, the same on every rank.
                log_step = self.step % c.log_every == 0 or self.step == c.max_steps
                if log_step or any(PeriodicTask.due(task, self.context) for task in self.tasks):
                    with self._ends_on_user_error(progress):
                        self.guard.report()
                if log_step:
                    self.metrics.write(time.perf_counter(), progress)
                # 3. The periodic tasks due now, in order.
                for task in self.tasks:
                    task.maybe_run(self.context)
                # 4. A stop signal (SIGTERM, SIGINT, SIGUSR1), agreed by every rank: save and leave.
                if self.stop_agreement.should_stop(self.step, signals):
                    stopped = True
                    self.log.info("stop requested: saving step %d and exiting (%s)", self.step,
                                  signals.signal_name or "a signal to another rank")
            with self._ends_on_user_error(progress):
                self.guard.report()
            progress.close()
            for task in self.tasks:  # the last evaluation and checkpoint
                task.end(self.context, stopped)
            # Still under the handlers: a repeated SIGTERM must not kill the process after its work is saved.
            if acc.is_main_process and self.config.log.figures:
                plot_loss(self.run_dir)
            log_time_shares(self.log, self.progress.train_seconds - launch_started_at, self.tasks)
            self.log.info("done at step %d; outputs in %s", self.step, self.run_dir)
            self._end()
        return {"step": self.step, "stopped": stopped, "metrics": self.metrics.last, "run_dir": str(self.run_dir)}

    def train_step(self, batches) -> dict[str, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean terms as device
        tensors, with no read back to the host (that would drain the GPU queue every step)."""
        acc, c = self.accelerator, self.config.train
        self.lr = lr = lr_at(c, self.step)  # by hand: Accelerate steps prepared schedulers once per process
        for group, group_lr in zip(self.optimizer.param_groups, self._group_lrs(lr)):
            group["lr"] = group_lr
        position = (self.progress.epoch, self.progress.offset)
        sums: dict[str, torch.Tensor] = {}
        grad_norm = skip = inputs_finite = None
        repa, entropy_weight = self.repa, self.config.model.topology_entropy_weight
        for _ in range(c.grad_accum):
            x, y, *clean = prepare_batch(self.data, next(batches), acc.device, self.generator,
                                         clean_images=repa is not None)
            finite = torch.isfinite(x).all()
            inputs_finite = finite if inputs_finite is None else inputs_finite & finite
            draws = self.draw_timesteps_and_noise(x)
            with acc.accumulate(*self.trained_modules):
                with repa.tap.attached(self.raw_model.topology) if repa is not None else nullcontext():
                    terms = self.objective.losses(self.model, x, y, draws)
                loss = terms["loss"].mean()
                if entropy_weight:  # logged as train/topology_entropy (unweighted)
                    terms["topology_entropy"] = topology_entropy(self.raw_model.topology)
                    loss = loss + entropy_weight * terms["topology_entropy"]
                if repa is not None:  # logged as train/repa_loss (unweighted)
                    terms["repa_loss"] = repa.loss(self.projector, clean[0])
                    loss = loss + repa.weight * terms["repa_loss"]
                acc.backward(loss)
                for key, value in terms.items():
                    sums[key] = sums.get(key, 0.0) + value.detach().mean() / c.grad_accum
                if acc.sync_gradients:
                    grad_norm = self._grad_norm()
                    skip = self.guard.flag(self.step + 1, position, sums, grad_norm, inputs_finite)
                    self._optimizer_step(skip)
                self.optimizer.zero_grad(set_to_none=True)
        ema_update_(self.emas.values(), self.raw_model, self.step, skip)
        p = self.progress
        p.step += 1
        p.epoch, p.offset = advance_position(p.epoch, p.offset, c.global_batch_size, len(self.data.dataset))
        sums["grad_norm"] = grad_norm.float()
        sums["skipped"] = skip  # logged: the fraction of skipped steps
        return sums

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the trained modules, clipped to train.grad_clip when set (without
        clipping the gradients are only read: a clip to infinity would rescale every gradient by 1)."""
        acc, clip = self.accelerator, self.config.train.grad_clip
        params = [p for m in self.trained_modules for p in m.parameters() if p.grad is not None]
        if clip or acc.scaler is not None:  # fp16: Accelerate unscales the gradients first
            return acc.clip_grad_norm_(params, clip or float("inf"))
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def _optimizer_step(self, skip: torch.Tensor) -> None:
        """The update, masked by the guard's flag: the fused AdamW takes it as found_inf (a flagged step changes
        no weight, moment or step count); with fp16's GradScaler or no fused kernel the flag is read."""
        torch_optimizer = self.optimizer.optimizer
        if self.fused and self.accelerator.scaler is None:
            torch_optimizer.found_inf = skip
            try:
                self.optimizer.step()
            finally:
                del torch_optimizer.found_inf
        elif not bool(skip):
            self.optimizer.step()
        elif self.accelerator.scaler is not None:  # the scaler saw the overflow when unscaling; lower its scale
            self.accelerator.scaler.update()

    def _loader(self):
        """The loader from the run's data position (a resumed run goes on inside its epoch)."""
        acc, c = self.accelerator, self.config
        sampler = GlobalBatchSampler(len(self.data.dataset), c.train.global_batch_size, acc.num_processes,
                                     acc.process_index, c.train.grad_accum, c.train.seed, self.progress.epoch,
                                     self.progress.offset)
        return make_loader(self.data, sampler, c.data.num_workers, pin_memory=acc.device.type == "cuda")

    def draw_timesteps_and_noise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's training time and noise for a micro-batch, from this rank's generator."""
        return self.objective.draw(x, self.generator)

    def _group_lrs(self, lr: float) -> list[float]:
        """Each group's lr: the routing group's is lr x train.topology_lr_mult, 0 for its first
        train.topology_warmup_steps steps (AdamW leaves it in place while its moments warm up)."""
        c = self.config.train
        routing_lr = lr * c.topology_lr_mult if self.step >= c.topology_warmup_steps else 0.0
        return [routing_lr if k == self.routing_group else lr for k in range(len(self.optimizer.param_groups))]

    def _stop_requested(self) -> bool:
        """Whether a stop signal arrived during this launch (collective)."""
        return self.stop_agreement.should_stop(self.step, self._signals, force=True)

    @contextmanager
    def _ends_on_user_error(self, progress) -> Iterator[None]:
        """A user error in the body (the guard's non-finite stop, unreadable data) ends the run, nothing saved."""
        try:
            yield
        except UserError as err:
            self.log.error("%s", err)  # in log.txt too
            progress.close()
            self._end()
            raise

    def _log_start(self) -> None:
        acc, c, d = self.accelerator, self.config, self.data
        self.log.info("run dir %s: config.yaml, %s (text), logs/ (TensorBoard: tensorboard --logdir %s; %s), "
                      "checkpoints/<step>/, samples/<step>.png, topology.json/.png%s",
                      self.run_dir, LOG_FILE, self.run_dir / "logs", METRICS_FILE,
                      ", logs/evals.jsonl + quality.png (evaluation)" if c.train.eval_every else "")
        self.log.info("model %s (%s topology), %.2fM parameters, %.2f GFLOP per training image; data %s: %d samples, "
                      "%d classes, model input %dx%dx%d; %d process(es) x %d per device x %d accumulation = global "
                      "batch %d; mixed precision %s; MFU against %s TFLOP/s (%s)", c.model.name, c.model.topology,
                      sum(p.numel() for p in self.raw_model.parameters()) / 1e6, self.flops_per_image / 1e9, d.kind,
                      len(d.dataset), d.num_classes, d.in_channels, d.input_size, d.input_size, acc.num_processes,
                      self.micro_batch, c.train.grad_accum, c.train.global_batch_size, c.train.mixed_precision,
                      self.peak_tflops, self.peak_source)

    def _end(self) -> None:
        """Ends the trackers and the process group (else gloo aborts at exit), after dropping the DDP
        wrappers: one that outlives its group can abort the process when freed at interpreter exit."""
        self.model = self.projector = None
        self.trained_modules = ()
        self.accelerator.free_memory()
        gc.collect()
        if self.accelerator.is_main_process:
            release_run_dir(self.run_dir)
        self.accelerator.end_training()


def train(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Trains as `accelerate launch train.py` does; returns {"step", "stopped", "metrics", "run_dir"}."""
    try:
        trainer = Trainer(config, resume)
    except UserError:
        abandon_new_run_dir(config.run_dir)  # a refused start leaves no folder behind
        raise
    return trainer.run()
