"""Atomic, resumable checkpoints: RUN/checkpoints/<step>/ (the optimizer step, zero-padded to 7 digits):
    accelerate/          Accelerate's save_state: optimizer, grad scaler, RNG state of every rank
    rng/rank<R>.pt       the trainer's own per-rank generator (t, noise, flips, posterior draws)
    model_spec.json      \
    model.safetensors     > the trained-model files read by sample.py (ancre_dit.checkpoint)
    ema.safetensors      /
    topology.json/.png   the learned topology of the EMA model
    repa_projector.safetensors   with REPA only: its projector, for inspection (resume reads accelerate/)
    trainer_state.json   step, data position, layout; written last
Everything is written to checkpoints/.tmp-<step>/ and renamed when complete, so a crash mid-save
leaves earlier checkpoints untouched and `--resume auto` never sees a half-written folder.
"""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError

from ..errors import UserError
from ..checkpoint import (SPEC_FILE, WEIGHT_FILES, data_differences, load_safetensors_checked, make_model_spec,
                          read_json_checked, save_safetensors, weights_file, write_model_files)
from ..files import file_problem, write_atomic
from ..models import TopologyNotDefined, save_topology_json

STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate"
TMP_PREFIX = ".tmp-"


def step_name(step: int) -> str:
    return f"{step:07d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((int(p.name), p) for p in root.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / STATE_FILE).is_file())


def checkpoint_problem(folder: Path) -> str | None:
    """Why a complete-looking checkpoint cannot be resumed from (a file missing, or one whose
    structure is broken: see ancre_dit.files.file_problem), or None when it looks sound."""
    for name in (STATE_FILE, SPEC_FILE, *WEIGHT_FILES.values()):
        if not (folder / name).is_file():
            return f"{folder / name} is missing"
    if not (folder / ACCELERATE_DIR).is_dir():
        return f"{folder / ACCELERATE_DIR} is missing"
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return next((problem for problem in map(file_problem, files) if problem), None)


def check_resume_path(resume: str) -> Path:
    """A --resume PATH that is a checkpoint folder by its layout (checked before the run folder is claimed)."""
    path = Path(resume)
    if path.is_dir() and (path / STATE_FILE).is_file() and (path / ACCELERATE_DIR).is_dir():
        return path
    if checkpoints_dir(path).is_dir():
        raise UserError(f"--resume {resume} is a run folder, not one of its checkpoints; pass --resume auto with "
                        f"run_dir={resume} (its newest sound checkpoint), or --resume {checkpoints_dir(path)}/<step>")
    raise UserError(f"--resume {resume} is not a complete checkpoint folder (RUN/checkpoints/<step> "
                    f"holding {STATE_FILE}); pass one, or --resume auto")


def resolve_resume(resume: str | None, run_dir: str | Path, warn: Callable[[str], None] = print) -> Path | None:
    """`auto` -> newest sound checkpoint of the run (None if there is none; a damaged newer one is
    skipped with a warning); a path -> that checkpoint (a UserError if it is incomplete or damaged)."""
    if not resume:
        return None
    if resume != "auto":
        path = check_resume_path(resume)
        if problem := checkpoint_problem(path):
            raise UserError(f"--resume {resume}: the checkpoint is damaged ({problem}); pass another checkpoint, "
                            f"or --resume auto to take the newest sound one")
        return path
    found = list_checkpoints(run_dir)
    for _, folder in reversed(found):
        if (problem := checkpoint_problem(folder)) is None:
            return folder
        warn(f"--resume auto: skipping damaged checkpoint {folder} ({problem}); trying the previous one")
    if found:
        raise UserError(f"--resume auto: every checkpoint in {checkpoints_dir(run_dir)} is damaged; resume from a "
                        f"copy of a good one with --resume PATH, or use a new run_dir to start over")
    return None


def check_same_model(folder: Path, wanted_spec: dict[str, Any]) -> None:
    """The checkpoint holds the network and data the config builds, else one line saying what differs
    (instead of Accelerate's list of every unexpected state-dict key): the model name and kwargs, the
    diffusion / objective settings, then the data."""
    saved = read_json_checked(folder / SPEC_FILE)
    if not isinstance(saved, dict):
        raise UserError(f"{folder / SPEC_FILE} is damaged (not a JSON object); pick another checkpoint")
    wanted = json.loads(json.dumps(wanted_spec))  # tuples -> lists, as the saved JSON has them
    saved_model, diffs = saved.get("model", {}), []
    pairs = [({"model": saved_model.get("name")}, {"model": wanted["model"]["name"]}),
             (saved_model.get("kwargs", {}), wanted["model"]["kwargs"])]
    pairs += [(saved.get(k), wanted.get(k)) for k in sorted(set(saved) | set(wanted))
              if k not in ("model", "data", "step")]
    for old, new in pairs:
        if isinstance(old, dict) and isinstance(new, dict):
            # The topology first: changing it changes its options too, and it is the one to name.
            for key in sorted(set(old) | set(new), key=lambda k: (k != "topology", k)):
                if old.get(key) != new.get(key):
                    diffs.append(f"{key} {old.get(key)} in the checkpoint, {new.get(key)} in the config")
        elif old != new:
            diffs.append(f"{old} in the checkpoint, {new} in the config")
    if diffs:
        raise UserError(f"--resume {folder} holds another model than the config builds ({'; '.join(diffs)}); "
                        f"resume with the config the run was started with ({folder.parent.parent / 'config.yaml'}), "
                        f"or start a new run_dir")
    if diffs := data_differences(saved.get("data") or {}, wanted_spec.get("data") or {}):
        raise UserError(f"--resume {folder} was trained on data the config changes ({'; '.join(diffs)}): the "
                        "resumed steps would learn from other inputs; resume with the run's own data settings "
                        f"({folder.parent.parent / 'config.yaml'}), or start a new run_dir")


def data_spec(data) -> dict[str, Any]:
    """The checkpoint spec's "data" entry of a training.data.DataInfo: what sampling needs to decode."""
    return {"kind": data.kind, "image_size": data.image_size, "image_channels": data.image_channels,
            "num_classes": data.num_classes, "vae": data.vae, "scaling_factor": data.scaling_factor,
            **(data.latent_norm.spec() if data.latent_norm is not None else {})}


def rng_file(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank{rank}.pt"


def save_checkpoint(accelerator, run_dir: str | Path, step: int, generator: torch.Generator,
                    write_files: Callable[[Path], None], trainer_state: dict[str, Any], keep_last: int = 0) -> Path:
    """Collective. `write_files(folder)` (main process) writes the model files and the topology, the trainer
    state goes last, then the rename; a failed write removes the temporary folder, one UserError everywhere."""
    root = checkpoints_dir(run_dir)
    final, tmp = root / step_name(step), root / f"{TMP_PREFIX}{step_name(step)}"

    def main_first() -> None:
        if tmp.exists():  # left over by a crash during an earlier save of this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def every_rank() -> None:
        accelerator.save_state(output_dir=str(tmp / ACCELERATE_DIR))
        path = rng_file(tmp, accelerator.process_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"generator": generator.get_state()}, path)

    def main_last() -> None:
        write_files(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
        if final.exists():  # the same step saved before (e.g. a rerun with the same max_steps)
            remove_checkpoint(final)
        tmp.rename(final)
        if keep_last > 0:  # the newest keep_last stay (what a kill mid-removal leaves, the next claim removes)
            for _, folder in list_checkpoints(run_dir)[:-keep_last]:
                remove_checkpoint(folder)

    _agreed_write(accelerator, main_first if accelerator.is_main_process else None, root, tmp)
    _agreed_write(accelerator, every_rank, root, tmp)
    _agreed_write(accelerator, main_last if accelerator.is_main_process else None, root, tmp)
    return final


def _is_disk_full(err: BaseException, free: int, needed: int) -> bool:
    """ENOSPC / EDQUOT as an OSError, or as safetensors' text; torch.save (Accelerate's optimizer
    file) reports a short write only as "unexpected pos", so a failed write with less free space
    than a checkpoint takes counts as a full disk too."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(s in str(err) for s in ("No space left", "os error 28", "code: 28", "Disk quota exceeded")):
        return True
    return isinstance(err, (RuntimeError, SafetensorError)) and free < max(needed, 1 << 20)


def _write_problem(err: BaseException, root: Path, tmp: Path) -> str | None:
    """The one line for a failed checkpoint write, or None when `err` is no file-system failure (a bug)."""
    earlier = [_folder_bytes(p) for _, p in list_checkpoints(root.parent)]
    needed = max(earlier) if earlier else _folder_bytes(tmp)
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    if _is_disk_full(err, free, needed):
        return (f"no space left on the device while writing the checkpoint {tmp} (a checkpoint needs "
                f"{'about' if earlier else 'over'} {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free in {root}); "
                f"the temporary folder is removed and earlier checkpoints are intact: free space, then rerun with "
                f"--resume auto")
    if isinstance(err, OSError):
        return (f"cannot write the checkpoint {tmp} ({err.strerror or err}); the temporary folder is removed and "
                f"earlier checkpoints are intact: make {root} writable, then rerun with --resume auto")
    return None


def _agreed_write(accelerator, write: Callable[[], None] | None, root: Path, tmp: Path) -> None:
    """Runs this rank's part of a save (None: nothing here), then agrees with the other ranks: when any
    failed, the temporary folder is removed and every rank raises the same UserError (none waits forever)."""
    problem = None
    if write is not None:
        try:
            write()
        except (OSError, RuntimeError, SafetensorError) as err:
            problem = _write_problem(err, root, tmp)
            if problem is None:
                raise
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        problem = next((p for p in gather_object([problem]) if p), None)
    if problem:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        raise UserError(problem)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def remove_checkpoint(folder: Path) -> None:
    """Renamed out of the checkpoint namespace first, then deleted: a kill mid-deletion never
    leaves a half-deleted folder that still looks complete to --resume auto."""
    doomed = folder.with_name(f"{TMP_PREFIX}deleting-{folder.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def topology_matrix(model: torch.nn.Module) -> torch.Tensor | None:
    """The model's (K, K) topology on the CPU, or None for schemes that have none (HC, mHC)."""
    try:
        return model.topology.probabilities().detach().float().cpu()
    except TopologyNotDefined:
        return None


class CheckpointManager:
    """The checkpoints of the run of `ctx` (a periodic.RunContext): `save()` writes its current step
    (collective), `load(folder)` restores the weights, Accelerate's state (optimizer, scaler and RNG only),
    this rank's generator and the progress. The weights are the unwrapped modules' own files (the ones
    sample.py reads), so a run resumes at another world size, with compile or DDP switched."""

    def __init__(self, ctx, model_kwargs: dict[str, Any], repa, generator: torch.Generator):
        self.ctx, self.repa, self.generator = ctx, repa, generator
        self.spec = make_model_spec(ctx.config.model.name, model_kwargs, ctx.objective.spec(), data_spec(ctx.data), 0)
        ctx.accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
        ctx.accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())

    def save(self) -> Path:
        ctx, c, p = self.ctx, self.ctx.config, self.ctx.progress
        state = {"step": p.step, "data": {"epoch": p.epoch, "offset": p.offset},
                 "num_processes": ctx.accelerator.num_processes, "global_batch_size": c.train.global_batch_size,
                 "seed": c.train.seed, "model": c.model.name, "train_seconds": round(p.train_seconds, 3)}
        if self.repa is not None:
            state["repa"] = self.repa.settings(c.repa)
        path = save_checkpoint(ctx.accelerator, ctx.run_dir, p.step, self.generator, self._write_files, state,
                               keep_last=c.train.keep_last)
        ctx.log.info("step %d: checkpoint saved to %s", p.step, path)
        p.last_saved = p.step
        return path

    def _write_files(self, folder: Path) -> None:
        ctx, step, topology = self.ctx, self.ctx.progress.step, self.ctx.config.model.topology
        ema = ctx.ema_model
        write_model_files(folder, {**self.spec, "step": step}, ctx.raw_model.state_dict(), ema.state_dict())
        for name, other in ctx.emas.items():
            if name != "ema":  # (written with the model above)
                save_safetensors(other.module.state_dict(), folder / weights_file(name))
        if self.repa is not None:  # resume reads it (sampling never does)
            save_safetensors(self.repa.projector.state_dict(), folder / self.repa.PROJECTOR_FILE)
        # The EMA's topology (JSON, and its PNG) here and in the run dir; none for HC / mHC (no matrix).
        P, P_raw = topology_matrix(ema), topology_matrix(ctx.raw_model)
        if P is None:
            return
        for target in (folder, ctx.run_dir):
            save_topology_json(target / "topology.json", P, step=step, topology=topology, weights="ema",
                               training_probabilities=P_raw.tolist())
        if ctx.config.log.figures:
            from ..figures import plot_topology_heatmap
            png = plot_topology_heatmap(P, folder / "topology.png", title=f"{topology} topology (EMA), step {step}")
            write_atomic(ctx.run_dir / "topology.png", png.read_bytes())  # drawn once, copied

    def load(self, folder: Path, seed_of_rank: Callable[[int], int]) -> None:
        """`seed_of_rank(step)`: this rank's generator seed when the checkpoint has no file for it
        (written with fewer processes: the resume is then not bitwise exact)."""
        from .repa import check_resume as check_same_repa

        ctx, acc, p = self.ctx, self.ctx.accelerator, self.ctx.progress
        check_same_model(folder, self.spec)  # one line on a mismatch, before Accelerate reads anything
        state = read_json_checked(folder / STATE_FILE)
        check_same_repa(folder, state, self.repa, ctx.config.repa)
        # Read on the host (a rank's device name such as cpu:0 is no valid safetensors device).
        ctx.raw_model.load_state_dict(load_safetensors_checked(folder / WEIGHT_FILES["model"], device="cpu"))
        for name, ema in ctx.emas.items():
            path = folder / weights_file(name)
            if not path.is_file():
                raise UserError(f"--resume {folder} holds no {path.name}: train.ema_decays or train.phema.stds "
                                "changed since; resume with the run's own settings, or start a new run_dir")
            ema.module.load_state_dict(load_safetensors_checked(path, device="cpu"))
        if self.repa is not None:
            self.repa.projector.load_state_dict(
                load_safetensors_checked(folder / self.repa.PROJECTOR_FILE, device="cpu"))
        acc.load_state(str(folder / ACCELERATE_DIR))  # optimizer, scaler, RNG (the hooks drop the models)
        p.step = p.last_saved = int(state["step"])
        p.epoch, p.offset = int(state["data"]["epoch"]), int(state["data"]["offset"])
        p.train_seconds = float(state.get("train_seconds", 0.0))
        path = rng_file(folder, acc.process_index)
        if path.is_file():
            self.generator.set_state(torch.load(path, map_location="cpu", weights_only=True)["generator"])
        else:
            self.generator.manual_seed(seed_of_rank(p.step))
            ctx.log.warning("%s was written by %d process(es); rank %d starts a fresh random stream, so this "
                            "resume is not bitwise exact", folder, state["num_processes"], acc.process_index)
        ctx.log.info("resumed from %s at step %d", folder, p.step)

    def last_good(self) -> str:
        found = list_checkpoints(self.ctx.run_dir)
        return str(found[-1][1]) if found else "none (no checkpoint saved yet)"
