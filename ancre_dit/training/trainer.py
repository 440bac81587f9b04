"""The training loop: DiT's diffusion (or SiT's flow) objective with Accelerate (CPU, one or many GPUs, many nodes).

One optimizer step consumes one global batch = per-device batch x processes x accumulation. Every
random draw is reproducible from saved state: the data order is a function of (seed, epoch), the
timesteps / noise / flips / posterior draws come from a per-rank generator saved in checkpoints,
and the model's label dropout uses the global RNG, which Accelerate saves and restores per rank.
"""
from __future__ import annotations

import itertools
import gc
import logging
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from timm.utils import ModelEmaV3
from tqdm.auto import tqdm

from ..errors import UserError
from ..hardware import configure_precision
from ..files import append_jsonl, read_jsonl
from ..diffusion import build_objective
from ..models import create_model
from ..models.layers import DEFAULTS as BLOCK_DEFAULTS
from ..models.topologies.analysis import check_entropy_topology, topology_entropy
from ..checkpoint import WEIGHT_FILES, make_model_spec, write_model_files
from ..checkpoint import load_safetensors_checked
from . import checkpointing as ckpt
from .config import flat_config, save_config
from .config_checks import check_batch_layout, diffusion_spec
from .config_schema import AGGREGATION_DEFAULTS, Config, topology_options_of
from .guards import NonFiniteGuard
from .periodic import RunContext, TrainProgress, build_tasks, topology_matrix, write_topology_files
from .data import DataInfo, GlobalBatchSampler, advance_position, build_data, describe, make_loader, prepare_batch
from .repa import RepaAlignment

LOG_FILE = "log.txt"
METRICS_FILE = "metrics.jsonl"


def _seed(*parts: int) -> int:
    """A 32-bit seed mixed from several integers (distinct streams per rank and purpose)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def _make_logger(run_dir: Path, main: bool) -> logging.Logger:
    logger = logging.getLogger(f"ancre_dit.train.{run_dir.resolve()}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if main else logging.WARNING)
    if main:
        fmt = logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S")
        for handler in (logging.FileHandler(run_dir / LOG_FILE), logging.StreamHandler()):
            handler.setFormatter(fmt)
            logger.addHandler(handler)
    return logger


class _StopFlag:
    """SIGINT / SIGTERM ask for a clean stop: finish the step, checkpoint, exit. A second
    Ctrl-C falls back to the default behaviour (immediate KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook runners): no handler
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Builds everything from a Config; `run()` trains to train.max_steps (or until a signal)."""

    def __init__(self, config: Config, resume: str | None = None):
        self.config = c = config
        self.run_dir = Path(c.run_dir)
        trackers = []
        if c.log.tensorboard:
            trackers.append("tensorboard")
        if c.log.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise UserError("log.wandb=true but wandb is not installed; pip install wandb, or set log.wandb=false") from None
            trackers.append("wandb")
        self.accelerator = acc = Accelerator(
            mixed_precision=c.train.mixed_precision,
            gradient_accumulation_steps=c.train.grad_accum,
            log_with=trackers or None,
            project_config=ProjectConfiguration(project_dir=str(self.run_dir), logging_dir=str(self.run_dir / "logs")),
        )
        self.micro_batch = check_batch_layout(c, acc.num_processes)
        if acc.is_main_process:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        self.log = _make_logger(self.run_dir, acc.is_main_process)
        configure_precision(acc.device, c.train.tf32)

        # Same seed on every rank for the model (DDP also broadcasts rank 0's weights), then a
        # distinct seed per rank for everything random during training.
        set_seed(c.train.seed)
        self.data: DataInfo = build_data(c)
        self.model_kwargs = self._model_kwargs()
        self.raw_model = create_model(c.model.name, **self.model_kwargs).to(acc.device)
        self.raw_model.train()
        self.ema = ModelEmaV3(self.raw_model, decay=c.train.ema_decay, use_warmup=c.train.ema_warmup)
        self.ema.requires_grad_(False)
        self.raw_model.set_grad_checkpointing(c.train.grad_checkpointing)
        self.objective = build_objective(diffusion_spec(c))
        self.repa = self._build_repa()  # None with repa.weight 0
        rank = acc.process_index
        set_seed(_seed(c.train.seed, rank, 0))
        self.generator = torch.Generator(device=acc.device).manual_seed(_seed(c.train.seed, rank, 1))

        optimizer = torch.optim.AdamW(self._param_groups(), lr=c.train.lr, betas=(c.train.adam_beta1, c.train.adam_beta2),
                                      weight_decay=c.train.weight_decay)
        model = torch.compile(self.raw_model) if c.train.compile else self.raw_model
        # REPA's projector is prepared as a model of its own: wrapped for several processes (its
        # gradients are averaged like the model's) and in Accelerate's saved state (exact resume).
        extra = [self.repa.projector] if self.repa is not None else []
        self.model, *prepared, self.optimizer = acc.prepare(model, *extra, optimizer)
        self.projector = prepared[0] if prepared else None
        self.trained_modules = (self.model, *prepared)

        self.progress = TrainProgress()
        self.epoch, self.offset = 0, 0
        self.resumed_from = ckpt.resolve_resume(resume, self.run_dir, warn=self.log.warning)
        if self.resumed_from is not None:
            self._load(self.resumed_from)
        elif resume == "auto":
            self.log.info("--resume auto: no complete checkpoint in %s, starting from scratch", ckpt.checkpoints_dir(self.run_dir))
        if acc.is_main_process:
            save_config(c, self.run_dir / "config.yaml")
        acc.init_trackers(c.log.project, config=flat_config(c))
        self.learnable_topology = any(True for _ in self.raw_model.topology.parameters())
        self.guard = NonFiniteGuard(acc, c.train.nonfinite, c.train.nonfinite_max_skips, self._last_good_checkpoint,
                                    self.log.warning, scaler_handles_grads=c.train.mixed_precision == "fp16")
        self.entropy_weight = c.model.topology_entropy_weight
        if self.entropy_weight:
            check_entropy_topology(self.raw_model.topology)
        self.context = RunContext(run_dir=self.run_dir, config=c, accelerator=acc, data=self.data,
                                  objective=self.objective, raw_model=self.raw_model, ema_model=self.ema.module,
                                  data_spec=self.data_spec(), log=self.log, progress=self.progress, save=self.save,
                                  stop_requested=self._stop_requested)
        self._stop_flag: _StopFlag | None = None
        self.tasks = build_tasks(self.context)  # sample grids, evaluation, checkpoints (periodic.py)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def train_seconds(self) -> float:
        return self.progress.train_seconds

    # -- setup helpers --------------------------------------------------------------------
    def _model_kwargs(self) -> dict[str, Any]:
        m, d = self.config.model, self.data
        kwargs: dict[str, Any] = dict(topology=m.topology, input_size=d.input_size, in_channels=d.in_channels,
                                      num_classes=d.num_classes, learn_sigma=m.learn_sigma, class_dropout_prob=m.class_dropout)
        kwargs.update(topology_options_of(m))
        for key in ("depth", "hidden_size", "num_heads"):
            if getattr(m, key) is not None:
                kwargs[key] = getattr(m, key)
        # The block's layer choices only where they differ from the DiT block: specs of default runs
        # (and of runs from before the choices existed) stay what they were, so those runs resume.
        kwargs.update({key: getattr(m, key) for key, default in {**BLOCK_DEFAULTS, **AGGREGATION_DEFAULTS}.items()
                       if getattr(m, key) != default})
        return kwargs  # width / heads were checked with the config

    def _build_repa(self) -> RepaAlignment | None:
        """REPA's encoder, projector and tap (repa.weight > 0), for this model's token grid and width."""
        r, c = self.config.repa, self.config.train
        if not r.weight:
            return None
        grid = self.data.input_size // self.raw_model.patch_size
        repa = RepaAlignment(r, self.raw_model.pos_embed.shape[-1], grid, self.accelerator.device,
                             bf16=c.mixed_precision == "bf16", seed=_seed(c.seed, 2))
        self.log.info("REPA: the state after block %d, projected to %d dims, aligned with the patch tokens of %s at "
                      "%d px (weight %g; logged as train/repa_loss)", r.depth, repa.encoder.dim, r.encoder,
                      repa.encoder.resolution, r.weight)
        return repa

    def _param_groups(self) -> list[dict[str, Any]]:
        """Trainable parameters only, in two groups: the backbone, and the routing parameters the
        topology declares (their own weight decay, 0 by default, and their own lr schedule: see
        `_group_lrs`). `self.routing_group` is the index of the second (None when it is empty).
        With REPA, its projector is a last group with the backbone's lr and decay."""
        c = self.config.train
        routing = {id(p) for p in self.raw_model.topology.routing_parameters()}
        trainable = [p for p in self.raw_model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if id(p) not in routing]},
                  {"params": [p for p in trainable if id(p) in routing], "weight_decay": c.topology_weight_decay}]
        self.routing_group = 1 if groups[0]["params"] and groups[1]["params"] else (0 if groups[1]["params"] else None)
        if self.repa is not None:
            groups.append({"params": list(self.repa.projector.parameters())})
        return [g for g in groups if g["params"]]

    def _group_lrs(self, lr: float) -> list[float]:
        """Each group's lr at this step: the routing group's is lr x train.topology_lr_mult, and 0 for
        its first train.topology_warmup_steps steps. A zero lr leaves AdamW's parameters exactly where
        they are (its decay is lr x weight decay) while its moment estimates keep accumulating, so
        the routing starts moving from its initial values with warmed-up moments."""
        c = self.config.train
        routing_lr = lr * c.topology_lr_mult if self.step >= c.topology_warmup_steps else 0.0
        return [routing_lr if k == self.routing_group else lr for k in range(len(self.optimizer.param_groups))]

    def data_spec(self) -> dict[str, Any]:
        d = self.data
        return {"kind": d.kind, "image_size": d.image_size, "image_channels": d.image_channels,
                "num_classes": d.num_classes, "vae": d.vae, "scaling_factor": d.scaling_factor}

    def model_spec(self) -> dict[str, Any]:
        return make_model_spec(self.config.model.name, self.model_kwargs, self.objective.spec(), self.data_spec(),
                               self.step)

    # -- checkpoints ----------------------------------------------------------------------
    def _last_good_checkpoint(self) -> str:
        found = ckpt.list_checkpoints(self.run_dir)
        return str(found[-1][1]) if found else "none (no checkpoint saved yet)"

    def _write_files(self, folder: Path) -> None:
        write_model_files(folder, self.model_spec(), self.raw_model.state_dict(), self.ema.module.state_dict())
        write_topology_files(folder, self.run_dir, self.ema.module, self.raw_model, self.step, self.config.model.topology)
        if self.repa is not None:  # for inspection: resume reads it from Accelerate's state, sampling never
            from safetensors.torch import save_file
            save_file({k: v.detach().cpu().contiguous() for k, v in self.repa.projector.state_dict().items()},
                      str(folder / RepaAlignment.PROJECTOR_FILE))

    def save(self) -> Path:
        state = {"step": self.step, "data": {"epoch": self.epoch, "offset": self.offset},
                 "num_processes": self.accelerator.num_processes, "global_batch_size": self.config.train.global_batch_size,
                 "seed": self.config.train.seed, "model": self.config.model.name,
                 "train_seconds": round(self.train_seconds, 3)}
        path = ckpt.save_checkpoint(self.accelerator, self.run_dir, self.step, self.generator, self._write_files,
                                    state, keep_last=self.config.train.keep_last)
        self.log.info("step %d: checkpoint saved to %s", self.step, path)
        self.progress.last_saved = self.step
        return path

    def _load(self, folder: Path) -> None:
        acc = self.accelerator
        ckpt.check_same_model(folder, self.model_spec())  # one line on a mismatch, before Accelerate reads anything
        with_repa = (folder / RepaAlignment.PROJECTOR_FILE).is_file()
        if with_repa != (self.repa is not None):
            raise UserError(f"--resume {folder} was trained {'with' if with_repa else 'without'} REPA but repa.weight="
                            f"{self.config.repa.weight:g} here; resume with the config the run was started with "
                            f"({folder.parent.parent / 'config.yaml'}), or start a new run_dir")
        if self.repa is not None:
            self.repa.check_checkpoint(folder)
        state = ckpt.read_trainer_state(folder)
        acc.load_state(str(folder / ckpt.ACCELERATE_DIR))
        ema_state = load_safetensors_checked(folder / WEIGHT_FILES["ema"], device=acc.device)
        self.ema.module.load_state_dict(ema_state)
        self.progress.step = int(state["step"])
        self.epoch, self.offset = int(state["data"]["epoch"]), int(state["data"]["offset"])
        self.progress.train_seconds = float(state.get("train_seconds", 0.0))
        if not ckpt.load_generator_state(folder, acc.process_index, self.generator):
            self.generator.manual_seed(_seed(self.config.train.seed, acc.process_index, 1, self.step))
            self.log.warning("%s was written by %d process(es); rank %d starts a fresh random stream, so this "
                             "resume is not bitwise exact", folder, state["num_processes"], acc.process_index)
        self.log.info("resumed from %s at step %d", folder, self.step)

    # -- training -----------------------------------------------------------------------------
    def _loader(self):
        acc, c = self.accelerator, self.config
        sampler = GlobalBatchSampler(len(self.data.dataset), c.train.global_batch_size, acc.num_processes,
                                     acc.process_index, c.train.grad_accum, c.train.seed, self.epoch, self.offset)
        return make_loader(self.data, sampler, c.data.num_workers, pin_memory=acc.device.type == "cuda")

    def draw_timesteps_and_noise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's training time and noise for a micro-batch, from this rank's generator."""
        return self.objective.draw(x, self.generator)

    def train_step(self, batches) -> dict[str, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean terms."""
        acc, c = self.accelerator, self.config.train
        lr = c.lr * min(1.0, (self.step + 1) / c.warmup_steps) if c.warmup_steps else c.lr
        # lr by hand: Accelerate steps prepared schedulers once per process
        for group, group_lr in zip(self.optimizer.param_groups, self._group_lrs(lr)):
            group["lr"] = group_lr
        sums: dict[str, torch.Tensor] = {}
        grad_norm = torch.zeros((), device=acc.device)
        repa = self.repa
        for _ in range(c.grad_accum):
            x, y, *clean = prepare_batch(self.data, next(batches), acc.device, self.generator,
                                         clean_images=repa is not None)
            draws = self.draw_timesteps_and_noise(x)
            with acc.accumulate(*self.trained_modules):
                with repa.tap.attached(self.raw_model.topology) if repa is not None else nullcontext():
                    terms = self.objective.losses(self.model, x, y, draws)
                loss = terms["loss"].mean()
                if self.entropy_weight:  # logged as train/topology_entropy (unweighted)
                    terms["topology_entropy"] = topology_entropy(self.raw_model.topology)
                    loss = loss + self.entropy_weight * terms["topology_entropy"]
                if repa is not None:  # logged as train/repa_loss (unweighted)
                    terms["repa_loss"] = repa.loss(self.projector, clean[0])
                    loss = loss + repa.weight * terms["repa_loss"]
                acc.backward(loss)
                for key, value in terms.items():
                    sums[key] = sums.get(key, 0.0) + value.detach().mean() / c.grad_accum
                skip = False
                if acc.sync_gradients:
                    # max_norm=inf only measures the norm (the clip coefficient is clamped to 1).
                    params = itertools.chain(*(m.parameters() for m in self.trained_modules))  # the model (+ projector)
                    grad_norm = acc.clip_grad_norm_(params, c.grad_clip or float("inf"))
                    skip = self.guard.check(self.step + 1, sums, grad_norm)  # same answer on every rank
                if not skip:
                    self.optimizer.step()
                elif acc.scaler is not None:  # fp16: the scaler saw the overflow when unscaling; lower its scale
                    acc.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
        # Constant decay as in DiT; with ema_warmup, timm's 1 - (1 + n)^(-2/3) ramp capped at ema_decay
        # (short runs: a 0.999 EMA would still hold ~13% of the initial weights after 2000 steps).
        if not skip:
            self.ema.update(self.raw_model, step=self.step + 1 if c.ema_warmup else None)
        self.progress.step += 1
        self.epoch, self.offset = advance_position(self.epoch, self.offset, c.global_batch_size, len(self.data.dataset))
        sums["grad_norm"] = torch.as_tensor(grad_norm, device=acc.device).float()
        sums["lr"] = torch.tensor(lr, device=acc.device)
        sums["skipped"] = torch.tensor(float(skip), device=acc.device)  # logged: the fraction of skipped steps
        return sums

    def _stop_requested(self) -> bool:
        """Whether a stop signal arrived during this launch (agreed by all processes: collective)."""
        return self._stop_flag is not None and self._stop_agreed(self._stop_flag)

    def _stop_agreed(self, flag: _StopFlag) -> bool:
        """All ranks stop at the same step even if the signal reached them at different times."""
        if self.accelerator.num_processes == 1:
            return flag.requested
        t = torch.tensor([1.0 if flag.requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="sum").item() > 0)

    def _log_metrics(self, running: dict[str, torch.Tensor], count: int, elapsed: float, images: int) -> dict[str, float]:
        acc = self.accelerator
        keys = sorted(running)
        local = torch.stack([running[k] / count for k in keys])
        mean = acc.reduce(local, reduction="mean")  # the logged loss is averaged over all processes
        metrics = {k: float(v) for k, v in zip(keys, mean.tolist())}
        metrics["steps_per_sec"] = count / elapsed
        metrics["images_per_sec"] = images / elapsed
        metrics["train_seconds"] = round(self.train_seconds, 3)
        if acc.is_main_process:
            append_jsonl(self.run_dir / "logs" / METRICS_FILE, {"step": self.step, **metrics})
            tracked = {f"train/{k}": v for k, v in metrics.items()}
            P = topology_matrix(self.raw_model) if self.learnable_topology else None
            if P is not None:
                for j in range(P.shape[0]):
                    for i in range(j + 1):
                        tracked[f"topology/p_{j + 1}_{i}"] = float(P[j, i])
            acc.log(tracked, step=self.step)
        return metrics

    def run(self) -> dict[str, Any]:
        acc, c = self.accelerator, self.config.train
        self.log.info("run dir %s: config.yaml, %s (text), logs/ (TensorBoard: tensorboard --logdir %s; %s), "
                      "checkpoints/<step>/, samples/<step>.png, topology.json/.png%s",
                      self.run_dir, LOG_FILE, self.run_dir / "logs", METRICS_FILE,
                      ", logs/evals.jsonl + quality.png (evaluation)" if c.eval_every else "")
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        self.log.info("model %s (%s topology), %.2fM parameters; data %s; %d process(es) x %d per device x %d "
                      "accumulation = global batch %d; mixed precision %s", self.config.model.name,
                      self.config.model.topology, n_params / 1e6, describe(self.data), acc.num_processes,
                      self.micro_batch, c.grad_accum, c.global_batch_size, c.mixed_precision)
        self.progress.last_saved = self.step if self.resumed_from is not None else -1
        self._train_seconds_at_start = self.train_seconds
        last: dict[str, float] = {}
        batches = iter(self._loader())
        progress = tqdm(total=c.max_steps, initial=self.step, disable=not acc.is_main_process, desc="train",
                        dynamic_ncols=True)
        running: dict[str, torch.Tensor] = {}
        count, tick = 0, time.perf_counter()
        stopped = False
        with _StopFlag() as flag:
            self._stop_flag = flag
            for task in self.tasks:
                task.start(self.context)
            stopped = self._stop_agreed(flag)  # a stop during that work: checkpoint without another step
            while not stopped and self.step < c.max_steps:
                started = time.perf_counter()
                try:
                    terms = self.train_step(batches)
                except UserError as err:  # non-finite stop, unreadable data: nothing saved over the good checkpoints
                    self.log.error("%s", err)  # in log.txt too
                    progress.close()
                    self._end()
                    raise
                self.progress.train_seconds += time.perf_counter() - started
                for k, v in terms.items():
                    running[k] = running.get(k, 0.0) + v
                count += 1
                progress.update(1)
                if self.step % c.log_every == 0 or self.step == c.max_steps:
                    elapsed = time.perf_counter() - tick
                    last = self._log_metrics(running, count, elapsed, count * c.global_batch_size)
                    progress.set_postfix(loss=f"{last['loss']:.4f}", steps_s=f"{last['steps_per_sec']:.2f}")
                    self.log.info("step %d: loss %.4f, %.2f steps/s, %.1f images/s", self.step, last["loss"],
                                  last["steps_per_sec"], last["images_per_sec"])
                    running, count, tick = {}, 0, time.perf_counter()
                for task in self.tasks:
                    task.maybe_run(self.context)
                if self._stop_agreed(flag):
                    stopped = True
                    self.log.info("stop requested: saving step %d and exiting", self.step)
                    break
        progress.close()
        for task in self.tasks:
            task.finish(self.context, stopped)
        if acc.is_main_process:
            self._plot_loss()
        self._log_time_shares()
        self.log.info("done at step %d; outputs in %s", self.step, self.run_dir)
        self._end()
        return {"step": self.step, "stopped": stopped, "metrics": last, "run_dir": str(self.run_dir)}

    def _end(self) -> None:
        """Ends the trackers and destroys the process group (else gloo aborts at exit), after dropping
        the process-group wrappers (DDP) of the model and REPA's projector: a wrapper that outlives its
        group can abort the process when it is finally freed at interpreter exit."""
        self.model = self.projector = None
        self.trained_modules = ()
        self.accelerator.free_memory()
        gc.collect()
        self.accelerator.end_training()

    def _log_time_shares(self) -> None:
        """How this process's time split between training and the periodic tasks (this launch only
        for the tasks; training time summed over resumes)."""
        parts = {task.name: task.seconds for task in self.tasks}
        total = self._launch_train_seconds() + sum(parts.values())
        if total <= 0:
            return
        shares = ", ".join(f"{name} {sec:.1f} s ({100 * sec / total:.1f}%)" for name, sec in parts.items())
        self.log.info("time in this launch: training %.1f s (%.1f%%), %s", self._launch_train_seconds(),
                      100 * self._launch_train_seconds() / total, shares)

    def _launch_train_seconds(self) -> float:
        return self.train_seconds - self._train_seconds_at_start

    def _plot_loss(self) -> None:
        rows = read_jsonl(self.run_dir / "logs" / METRICS_FILE)
        if not rows:
            return
        from ..figures import plot_loss_curve
        plot_loss_curve([r["step"] for r in rows], [r["loss"] for r in rows], self.run_dir / "loss.png")


def train(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Trains as `accelerate launch train.py` does; returns {"step", "stopped", "metrics", "run_dir"}."""
    return Trainer(config, resume).run()
