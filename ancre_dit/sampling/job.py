"""A sampling job of any size: split over processes, saved in parts, resumable, merged at the end.

Part j (`batch_size` consecutive indices) goes to process j % world_size and is written atomically
to OUT.parts/part-<start>-<end>.npz, so a rerun skips what is done. Neither a part's batch nor a
sample's random streams depend on the number of processes, so the merged file is the same for 1 or
many. Rank 0 waits for the others' part files (no collective) and merges them in index order into
one ADM npz; the other processes exit once their parts are written.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from ..checkpoint import WEIGHT_FILES, data_differences, load_trained_model, weights_file
from ..cli import COLLECTIVE_TIMEOUT_S, job_processes
from ..data.adm_npz import load_adm_npz, save_adm_npz
from ..diffusion import SAMPLERS, SDEOptions
from ..errors import UserError
from ..files import write_atomic
from ..hardware import configure_precision
from .api import Decoder, SamplingPlan, assign_labels, build_decoder, check_classes, plan_sampling
from .guidance import Guidance
from .protocols import check_protocol_fits, record_path


@dataclass
class JobSettings:
    ckpt: str
    out: str
    num_samples: int
    weights: str = "ema"
    batch_size: int = 32
    sampler: str | None = None        # None: the checkpoint objective's default (ddpm / heun)
    steps: int | None = None          # None: that sampler's default (DDPM 250; flow euler 50, heun 25, sde 250)
    cfg_scale: float = 1.5
    cfg_channels: int | None = None
    guidance_interval: tuple[float, float] | None = None
    seed: int = 0
    sde_last_step: str = "mean"
    sde_last_step_size: float = 0.04
    sde_diffusion_norm: float = 1.0
    time_shift: float = 1.0           # LightningDiT's timestep shift of the ODE grid (euler, heun); 1 = none
    label_mode: str = "balanced"
    classes: list[int] | None = None
    precision: str = "fp32"
    vae: str | None = None
    png_dir: str | None = None
    grid: str | None = None
    grid_max: int = 100
    keep_parts: bool = False
    cpu: bool = False
    tf32: bool = True                 # TF32 matmuls on CUDA, as the trainer (train.tf32) and DiT's sampler
    compile: bool = False             # torch.compile the network, static shapes (the last part padded)
    protocol: str | None = None  # a named preset (protocols.py) the settings follow
    guide_ckpt: str | None = None     # autoguidance: the weaker model's checkpoint folder (its EMA weights)
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S  # under a launcher: a collective's wait


def part_ranges(num_samples: int, batch_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + batch_size, num_samples)) for s in range(0, num_samples, batch_size)]


def part_path(folder: Path, start: int, end: int) -> Path:
    return folder / f"part-{start:07d}-{end:07d}.npz"


def job_identity(settings: JobSettings, spec: dict) -> dict:
    """What decides a part's content (a rerun resumes only if it is unchanged). Left out: the sample count
    (sample i does not depend on it, so a job can be extended) and tf32 / compile (rounding only)."""
    keep = ("weights", "batch_size", "sampler", "steps", "cfg_scale", "cfg_channels", "guidance_interval",
            "seed", "label_mode", "classes", "precision", "vae", "sde_last_step", "sde_last_step_size",
            "sde_diffusion_norm")
    identity = {k: v for k, v in asdict(settings).items() if k in keep}
    identity["ckpt"] = str(Path(settings.ckpt).resolve())
    identity["step"] = spec.get("step")
    identity["guidance_interval"] = list(settings.guidance_interval) if settings.guidance_interval else None
    if settings.guide_ckpt:  # only when set: the identities of earlier jobs stay as they were
        identity["guide_ckpt"] = str(Path(settings.guide_ckpt).resolve())
    if settings.time_shift != 1:  # likewise
        identity["time_shift"] = float(settings.time_shift)
    return identity


def sde_options(s: JobSettings) -> SDEOptions:
    return SDEOptions(s.sde_last_step, float(s.sde_last_step_size), float(s.sde_diffusion_norm))


def check_settings(s: JobSettings) -> Guidance:
    """Flag checks that need no model, before anything is loaded (the sampler, steps and classes are
    checked once the checkpoint is)."""
    for flag, value in (("--num-samples", s.num_samples), ("--batch-size", s.batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1")
    if not 0 <= s.seed < 2**63:  # each sample's noise stream is seeded from (seed, index)
        raise UserError(f"--seed {s.seed} must be a non-negative integer (below 2^63)")
    if not str(s.out).endswith(".npz"):
        raise UserError(f"--out {s.out} must name an .npz file (ADM sample layout), e.g. --out samples.npz")
    if s.grid and s.grid_max < 1:
        raise UserError(f"--grid-max {s.grid_max} must be at least 1 (the number of samples the grid shows)")
    if sde_options(s) != SDEOptions() and s.sampler != "sde":
        raise UserError("--sde-last-step, --sde-last-step-size and --sde-diffusion-norm apply only to --sampler sde")
    guidance = Guidance(float(s.cfg_scale), s.cfg_channels, s.guidance_interval,
                        names=("--cfg-scale", "--cfg-channels", "--guidance-interval"))
    if s.guide_ckpt and float(s.cfg_scale) == 1:
        raise UserError("--guide-ckpt guides at --cfg-scale w != 1 (D_weak + w (D - D_weak)); set --cfg-scale, "
                        "e.g. 2, or drop --guide-ckpt")
    return guidance


def sample_part(plan: SamplingPlan, labels: np.ndarray, *, indices: np.ndarray, seed: int,
                decoder: Decoder, pad_to: int | None = None) -> np.ndarray:
    """One part's uint8 images. `pad_to`: a shorter part is filled up to that many samples (the next
    indices, the last label), the extra ones dropped, so that a compiled network sees one batch shape."""
    n = len(indices)
    if pad_to is not None and n < pad_to:
        indices = np.concatenate([indices, np.arange(indices[-1] + 1, indices[-1] + 1 + pad_to - n)])
        labels = np.concatenate([labels, np.full(pad_to - n, labels[-1])])
    return decoder(plan.latents(torch.as_tensor(labels, dtype=torch.long), indices, seed)[:n])


def _check_or_write_identity(folder: Path, identity: dict, is_main: bool) -> None:
    path = folder / "job.json"
    if path.is_file():
        old = json.loads(path.read_text())
        # Over both key sets: a key only one side records (guide_ckpt, time_shift) is a change too.
        changed = [k for k in {**old, **identity} if old.get(k) != identity.get(k)]
        if changed:
            raise UserError(f"{folder} holds parts of a different job ({', '.join(changed)} changed); rerun with "
                            f"the same settings to resume, or delete {folder} / choose another --out")
    elif is_main:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(identity, indent=1).encode())


def merge_parts(folder: Path, ranges: list[tuple[int, int]], labels: np.ndarray, out: Path) -> np.ndarray:
    """Parts in index order -> one ADM npz, filled into one preallocated array (the peak memory)."""
    images = None
    for start, end in ranges:
        path = part_path(folder, start, end)
        batch = load_adm_npz(path)
        if batch.labels is None or not np.array_equal(batch.labels, labels[start:end]):
            raise UserError(f"{path} has other labels than this job; delete {folder} and rerun")
        if images is None:
            images = np.empty((len(labels), *batch.images.shape[1:]), dtype=np.uint8)
        images[start:end] = batch.images
    save_adm_npz(out, images, labels)
    return images


def sample_parts(plan: SamplingPlan, labels: np.ndarray, ranges: list[tuple[int, int]], *,
                 decoder: Decoder, seed: int, pad_to: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, end, uint8 images) of each part in `ranges`; a part is the same whatever process draws it."""
    for start, end in ranges:
        yield start, end, sample_part(plan, labels[start:end], indices=np.arange(start, end), seed=seed,
                                      decoder=decoder, pad_to=pad_to)


def run_job(s: JobSettings) -> Path:
    """Samples s.num_samples images into s.out (+ PNG folder, grid); returns s.out."""
    guidance = check_settings(s)
    if s.weights not in WEIGHT_FILES and not (Path(s.ckpt) / weights_file(s.weights)).is_file():
        held = sorted(p.stem.removeprefix("ema-") for p in Path(s.ckpt).glob("*ema-*.safetensors"))
        raise UserError(f"--ema {s.weights.removeprefix('ema-')}: {s.ckpt} holds no {weights_file(s.weights)}; its "
                        f"EMAs: {', '.join(held) or 'none besides ema.safetensors (train.ema_decays)'}")
    with job_processes(s.cpu, s.collective_timeout_s) as state:
        configure_precision(state.device, s.tf32)
        model, spec = load_trained_model(s.ckpt, s.weights, state.device)
        guide = load_guide(s.guide_ckpt, spec, state.device, f"--guide-ckpt {s.guide_ckpt}",
                           f"--ckpt {s.ckpt}") if s.guide_ckpt else None
        return _run_model(model, spec, s, guidance, state, guide)


# Settings that shape training only: two checkpoints that differ in them sample the same process.
TRAINING_ONLY = ("learn_sigma", "time_sampling", "logit_mean", "logit_std", "cosine_loss_weight", "loss_weight")


def load_guide(path: str, spec: dict, device, name: str, sampled: str) -> torch.nn.Module:
    """Autoguidance's weak model (EMA weights) from the folder `path`; refused unless it shares the sampled
    model's data (latent space, normalisation, classes) and objective (the error calls them `name`, `sampled`)."""
    guide, guide_spec = load_trained_model(path, "ema", device)
    differs = data_differences(guide_spec["data"], spec["data"], where=("there", "here"))
    ours, theirs = ({k: v for k, v in d["diffusion"].items() if k not in TRAINING_ONLY} for d in (spec, guide_spec))
    differs += [f"diffusion.{k} {theirs.get(k)} there, {ours.get(k)} here" for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]
    if differs:
        raise UserError(f"{name} does not fit {sampled} ({'; '.join(differs)}); "
                        "autoguidance needs a model of the same latent space, classes and objective (a smaller "
                        "model or an earlier checkpoint of the same run)")
    return guide


def _run_model(model: torch.nn.Module, spec: dict, s: JobSettings, guidance: Guidance, state,
               guide: torch.nn.Module | None = None) -> Path:
    is_main, rank, world = state.is_main_process, state.process_index, state.num_processes
    log = print if is_main else (lambda *a, **k: None)
    num_classes = int(model.num_classes)
    check_protocol_fits(s.protocol, spec, int(model.in_channels))
    plan = plan_sampling(model, spec["diffusion"], sampler=s.sampler, steps=s.steps, guidance=guidance,
                         precision=s.precision, sde=sde_options(s), time_shift=s.time_shift, compile=s.compile,
                         names=("--sampler", "--steps", "--time-shift"), guide=guide)
    s = replace(s, sampler=plan.sampler, steps=plan.steps)  # the defaults resolved, for the log and the job identity
    if s.classes is not None:
        s = replace(s, classes=check_classes(s.classes, num_classes))
    decoder = build_decoder(spec["data"], model.in_channels, s.vae, state.device)
    labels = assign_labels(np.arange(s.num_samples), num_classes, seed=s.seed, mode=s.label_mode, classes=s.classes)

    out = Path(s.out)
    folder = out.with_suffix(".parts")
    _check_or_write_identity(folder, job_identity(s, spec), is_main)
    state.wait_for_everyone()

    ranges = part_ranges(s.num_samples, s.batch_size)
    mine = ranges[rank::world]
    todo = [r for r in mine if not part_path(folder, *r).is_file()]
    log(f"sampling {s.num_samples} images from {s.ckpt} (step {spec.get('step')}, {s.weights} weights) with "
        f"{plan.objective.name} {s.sampler}-{s.steps}{f' shifted {s.time_shift:g}' if s.time_shift != 1 else ''}, "
        f"{f'autoguidance {s.cfg_scale} by {s.guide_ckpt}' if guide is not None else f'cfg {s.cfg_scale}'}, "
        f"{world} process(es); parts in {folder}")
    finished = sum(part_path(folder, *r).is_file() for r in ranges)
    if finished:
        log(f"resuming: {finished} of {len(ranges)} parts already done")
    total = sum(e - b for b, e in mine)
    bar = tqdm(total=total, initial=total - sum(e - b for b, e in todo), unit="img", desc=f"rank {rank}/{world}",
               disable=not is_main, dynamic_ncols=True)
    # An adaptive sampler's steps follow the whole batch, so padding would change its samples.
    pad_to = s.batch_size if s.compile and not SAMPLERS[s.sampler].adaptive else None
    for start, end, images in sample_parts(plan, labels, todo, decoder=decoder, seed=s.seed, pad_to=pad_to):
        save_adm_npz(part_path(folder, start, end), images, labels[start:end])
        bar.update(end - start)
    bar.close()
    if not is_main:
        # No collective after this point: the main process's long merge holds no other in a barrier.
        return out

    wait_for_parts(folder, ranges, log)
    t0 = time.time()
    images = merge_parts(folder, ranges, labels, out)
    log(f"wrote {out}: arr_0 uint8 {tuple(images.shape)}, arr_1 labels ({time.time() - t0:.1f}s to merge)")
    record = record_path(out)
    record.write_text(json.dumps({**job_identity(s, spec), "num_samples": s.num_samples, "protocol": s.protocol},
                                 indent=1) + "\n")
    log(f"wrote the sampling settings to {record} (evaluate.py copies them into its results)")
    if s.png_dir:
        from PIL import Image

        Path(s.png_dir).mkdir(parents=True, exist_ok=True)
        for k, image in enumerate(tqdm(images, desc="png", unit="img", leave=False)):
            Image.fromarray(image).save(Path(s.png_dir) / f"{k:06d}.png")
        log(f"wrote {len(images)} PNGs to {s.png_dir}")
    if s.grid:
        from ..figures import save_image_grid

        shown = images[: s.grid_max]
        # One column per class when the labels are balanced.
        balanced = num_classes <= 32 and len(shown) % num_classes == 0 and np.array_equal(
            labels[: s.grid_max], np.arange(len(shown)) % num_classes)
        save_image_grid(shown, Path(s.grid), nrow=num_classes if balanced else math.ceil(math.sqrt(len(shown))))
        log(f"wrote grid of {len(shown)} images to {s.grid}")
    if not s.keep_parts:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def wait_for_parts(folder: Path, ranges: list[tuple[int, int]], log=print, poll_seconds: float = 2.0) -> None:
    """Blocks until every part file exists: a file wait, not a barrier, since the processes may finish far apart
    (no collective timeout applies); a process that dies takes the whole job down under the launcher."""
    missing = [r for r in ranges if not part_path(folder, *r).is_file()]
    if missing:
        log(f"waiting for {len(missing)} part(s) from the other processes")
    while missing:
        time.sleep(poll_seconds)
        missing = [r for r in missing if not part_path(folder, *r).is_file()]
