"""Atomic, resumable checkpoints: RUN/checkpoints/<step>/.

Layout of one checkpoint (folder name = the optimizer step, zero-padded to 7 digits):
    accelerate/          Accelerate's save_state: model, optimizer, grad scaler, RNG state of every rank
    rng/rank<R>.pt       the trainer's own per-rank generator (t, noise, flips, posterior draws)
    model_spec.json      \
    model.safetensors     > the trained-model files read by sample.py (ancre_dit.checkpoint)
    ema.safetensors      /
    topology.json/.png   the learned topology of the EMA model
    repa_projector.safetensors   with REPA only: its projector, for inspection (resume reads accelerate/)
    trainer_state.json   step, data position, layout; written last

Everything is written to checkpoints/.tmp-<step>/ and renamed when complete, so a crash mid-save
leaves earlier checkpoints untouched and `--resume auto` never sees a half-written folder.
Accelerate's automatic checkpoint naming counts saves, not steps, so we always pass the folder.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UserError
from ..checkpoint import SPEC_FILE, WEIGHT_FILES
from ..checkpoint import read_json_checked
from ..files import file_problem

STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate"
TMP_PREFIX = ".tmp-"


def step_name(step: int) -> str:
    return f"{step:07d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(folder: Path) -> bool:
    return folder.is_dir() and folder.name.isdigit() and (folder / STATE_FILE).is_file()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((int(p.name), p) for p in root.iterdir() if is_complete(p))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a complete-looking checkpoint cannot be resumed from (a file missing, or one whose
    structure is broken: see ancre_dit.files.file_problem), or None when it looks sound."""
    required = [folder / STATE_FILE, folder / SPEC_FILE, *(folder / name for name in WEIGHT_FILES.values())]
    for path in required:
        if not path.is_file():
            return f"{path} is missing"
    if not (folder / ACCELERATE_DIR).is_dir():
        return f"{folder / ACCELERATE_DIR} is missing"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        problem = file_problem(path)
        if problem:
            return problem
    return None


def resolve_resume(resume: str | None, run_dir: str | Path, warn: Callable[[str], None] = print) -> Path | None:
    """`auto` -> newest sound checkpoint of the run (None if there is none; a damaged newer one is
    skipped with a warning); a path -> that checkpoint (a UserError if it is incomplete or damaged)."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        for _, folder in reversed(found):
            problem = checkpoint_problem(folder)
            if problem is None:
                return folder
            warn(f"--resume auto: skipping damaged checkpoint {folder} ({problem}); trying the previous one")
        if found:
            raise UserError(f"--resume auto: every checkpoint in {checkpoints_dir(run_dir)} is damaged; resume from a "
                            f"copy of a good one with --resume PATH, or use a new run_dir to start over")
        return None
    path = Path(resume)
    if not (path.is_dir() and (path / STATE_FILE).is_file() and (path / ACCELERATE_DIR).is_dir()):
        raise UserError(f"--resume {resume} is not a complete checkpoint folder (RUN/checkpoints/<step> "
                        f"holding {STATE_FILE}); pass one, or --resume auto")
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"--resume {resume}: the checkpoint is damaged ({problem}); pass another checkpoint, "
                        f"or --resume auto to take the newest sound one")
    return path


def model_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'key: A in the checkpoint, B in the config' for everything that defines the network and its
    objective (model name and kwargs, the diffusion / objective settings); data and step are left out."""
    wanted = json.loads(json.dumps(wanted))  # tuples -> lists, as the saved JSON has them
    diffs = []
    if saved.get("model", {}).get("name") != wanted["model"]["name"]:
        diffs.append(f"model {saved.get('model', {}).get('name')} in the checkpoint, {wanted['model']['name']} in the config")
    pairs = [(saved.get("model", {}).get("kwargs", {}), wanted["model"]["kwargs"])]
    pairs += [(saved.get(k), wanted.get(k)) for k in sorted(set(saved) | set(wanted)) if k not in ("model", "data", "step")]
    for old, new in pairs:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    diffs.append(f"{key} {old.get(key)} in the checkpoint, {new.get(key)} in the config")
        elif old != new:
            diffs.append(f"{old} in the checkpoint, {new} in the config")
    return diffs


def check_same_model(folder: Path, wanted_spec: dict[str, Any]) -> None:
    """Before Accelerate loads anything: the checkpoint must hold the network the config builds,
    else one line saying what differs (instead of a list of every unexpected state-dict key)."""
    saved = read_json_checked(folder / SPEC_FILE)
    if not isinstance(saved, dict):
        raise UserError(f"{folder / SPEC_FILE} is damaged (not a JSON object); pick another checkpoint")
    diffs = model_differences(saved, wanted_spec)
    if diffs:
        raise UserError(f"--resume {folder} holds another model than the config builds ({'; '.join(diffs)}); "
                        f"resume with the config the run was started with ({folder.parent.parent / 'config.yaml'}), "
                        f"or start a new run_dir")


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return read_json_checked(folder / STATE_FILE)


def rng_file(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank{rank}.pt"


def save_checkpoint(accelerator, run_dir: str | Path, step: int, generator: torch.Generator,
                    write_files: Callable[[Path], None], trainer_state: dict[str, Any], keep_last: int = 0) -> Path:
    """Collective: every rank must call it. `write_files(folder)` (main process only) writes the
    trained-model files and the topology; the trainer state goes last, then the rename."""
    root = checkpoints_dir(run_dir)
    final = root / step_name(step)
    tmp = root / f"{TMP_PREFIX}{step_name(step)}"
    if accelerator.is_main_process:
        if tmp.exists():  # left over by a crash during an earlier save of this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(output_dir=str(tmp / ACCELERATE_DIR))
    path = rng_file(tmp, accelerator.process_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"generator": generator.get_state()}, path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_files(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
        if final.exists():  # the same step saved before (e.g. a rerun with the same max_steps)
            remove_checkpoint(final)
        tmp.rename(final)
        prune_checkpoints(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Deletes all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    root = checkpoints_dir(run_dir)
    for stale in root.glob(f"{TMP_PREFIX}deleting-*"):  # left by a kill during an earlier removal
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return []
    doomed = [p for _, p in list_checkpoints(run_dir)[:-keep_last]]
    for p in doomed:
        remove_checkpoint(p)
    return doomed


def remove_checkpoint(folder: Path) -> None:
    """Renamed out of the checkpoint namespace first, then deleted: a kill mid-deletion never
    leaves a half-deleted folder that still looks complete to --resume auto."""
    doomed = folder.with_name(f"{TMP_PREFIX}deleting-{folder.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load_generator_state(folder: Path, rank: int, generator: torch.Generator) -> bool:
    """Restores this rank's generator; False when the checkpoint has no file for this rank
    (it was written with fewer processes)."""
    path = rng_file(folder, rank)
    if not path.is_file():
        return False
    generator.set_state(torch.load(path, map_location="cpu", weights_only=True)["generator"])
    return True
