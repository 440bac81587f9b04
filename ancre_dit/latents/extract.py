"""Images -> VAE latent shards: the work of one process of a (possibly multi-process) run.

Shard k holds the images at positions [k * shard_size, (k + 1) * shard_size) of the source's listing, minus
skipped images, and is written by process k % world. Images are batched within a shard only, so a shard's
values do not depend on how many processes ran. Process 0 writes the manifest and the report once every
shard is on disk (after a barrier).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ancre_dit.errors import UserError
from ancre_dit.data.latent_shards import (FORMAT_NAME, FORMAT_VERSION, IMAGE_KEY, MANIFEST_NAME, REPORT_NAME,
                                         shard_file_name)
from ancre_dit.data.image_folder import LoadedImage
from ancre_dit.data.latent_norm import channel_statistics, moment_sums
from ancre_dit.files import write_atomic
from ancre_dit.latents.image_datasets import ImageSource, open_source
from ancre_dit.latents.shards import (checksum_path, read_checksum, read_shard_meta, remove_stale_tmp,
                                      shard_is_complete, write_shard)
from ancre_dit.vae import DTYPES, LoadedVAE, encode_moments, load_vae


@dataclass
class ExtractConfig:
    data_path: str
    vae: str
    out: str
    image_size: int = 256
    shard_size: int = 5000
    batch_size: int = 32
    num_workers: int = 0
    vae_dtype: str = "fp32"
    scaling_factor: float | None = None  # None: the VAE config's scaling_factor
    min_side: int = 8  # images with a shorter side are skipped as "too small"
    max_shards: int | None = None  # stop after this many new shards per process (split a job; tests)
    keep_images: bool = False  # also store each uint8 crop (REPA's encoder input): 3 x S x S bytes per image
    data_format: str | None = None  # imagefolder | hf | wds; None: detected from data_path (image_datasets.py)
    image_column: str = "image"  # Hugging Face datasets: the image and label columns
    label_column: str = "label"


@dataclass
class DistContext:
    """Who this process is; the script fills it from accelerate's PartialState."""
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    barrier: Callable[[], None] = lambda: None


@dataclass
class ExtractResult:
    num_shards: int
    written: list[int]  # shards this process wrote in this run
    reused: list[int]  # shards of this process that were already complete
    manifest: Path | None  # set on process 0 when the whole set is complete


def _fingerprint(cfg: ExtractConfig, images: ImageSource, vae: LoadedVAE) -> dict[str, Any]:
    """What must match for a rerun to reuse existing shards (same data, VAE, crop and sharding)."""
    rows = "\n".join(f"{p}\t{y}" for p, y in zip(images.files, images.labels))
    listing = hashlib.sha256(rows.encode()).hexdigest()
    fingerprint = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "image_size": cfg.image_size,
                   "vae": vae.name, "scaling_factor": vae.scaling_factor, "shift_factor": vae.shift_factor,
                   "vae_dtype": cfg.vae_dtype, "shard_size": cfg.shard_size, "min_side": cfg.min_side,
                   "num_files": len(images.files), "num_classes": len(images.class_names),
                   "file_list_sha256": listing}
    if cfg.keep_images:  # only when set: extractions without images keep their fingerprint (and resume)
        fingerprint["keep_images"] = True
    if images.format != "imagefolder":  # likewise: image-folder extractions keep theirs
        fingerprint["source"] = images.format
    return fingerprint


def _check_compatible(out: Path, fingerprint: dict[str, Any], num_shards: int) -> None:
    """Refuses to mix shards of another extraction into this one (every process checks the same files,
    so all fail together rather than leave some waiting at the barrier)."""
    sources = []
    if (out / MANIFEST_NAME).is_file():  # written atomically: one we wrote is never torn
        try:
            manifest = json.loads((out / MANIFEST_NAME).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise UserError(f"--out {out} holds a {MANIFEST_NAME} that is not a latent manifest of this package (no "
                            f"JSON object with format {FORMAT_NAME!r}): it belongs to other data; give a new or "
                            f"empty --out folder")
        sources.append((MANIFEST_NAME, manifest.get("extraction")))
    for path in sorted(out.glob("shard-*.safetensors")):
        meta = read_shard_meta(path)
        # An unreadable shard, or one whose bytes no longer match its checksum, is simply redone.
        if meta is not None and (meta.get("extraction") == fingerprint or shard_is_complete(path)):
            sources.append((path.name, meta.get("extraction")))
    for name, theirs in sources:
        if theirs != fingerprint:
            theirs = theirs if isinstance(theirs, dict) else {}
            diff = [k for k in fingerprint if theirs.get(k) != fingerprint[k]]
            shown = ", ".join(f"{k}: {theirs.get(k)!r} there vs {fingerprint[k]!r} now" for k in diff[:3])
            raise UserError(f"{out}/{name} comes from a different extraction ({shown}); use a new --out "
                            "folder or delete the old shards, or rerun with the original flags to resume")
    names = {shard_file_name(k) for k in range(num_shards)}
    if extra := [p.name for p in out.glob("shard-*.safetensors") if p.name not in names]:
        raise UserError(f"{out} holds {extra[0]} beyond the {num_shards} shards of this data; use a new --out folder")


def _encode_batch(vae: LoadedVAE, items: list[LoadedImage], images: ImageSource,
                  keep_images: bool) -> dict[str, torch.Tensor]:
    """One batch's rows of the shard's tensors (with the crops, `keep_images`); {} when all were skipped."""
    good = [it for it in items if it.array is not None]
    if not good:
        return {}
    pixels = torch.from_numpy(np.stack([it.array for it in good]))
    # The image and its horizontal flip (of the crop, as DiT flips after cropping) in one batch.
    mean, std = encode_moments(vae, torch.cat([pixels, pixels.flip(2)]))
    n = len(good)
    # (2n, C, h, w) -> (n, 2, C, h, w): row i holds [image i, flipped image i]; stored in float16
    mean, std = (m.view(2, n, *m.shape[1:]).transpose(0, 1).half().cpu() for m in (mean, std))
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
        dtype = next(vae.vae.parameters()).dtype
        cause = (f"an overflow of {dtype} is likely; rerun with --vae-dtype fp32 to resume" if dtype != torch.float32
                 else "the VAE ran in fp32, so its weights (or --scaling-factor) give values beyond float16's range "
                 "in which latents are stored; check the VAE folder and the scaling factor")
        raise UserError(f"the VAE gave non-finite latents near {images.files[good[0].position]}: {cause}")
    rows = {"mean": mean, "std": std, "label": torch.tensor([images.labels[it.position] for it in good]),
            "index": torch.tensor([it.position for it in good])}
    if keep_images:  # the crop the VAE saw, unflipped, channels first
        rows[IMAGE_KEY] = pixels.permute(0, 3, 1, 2).contiguous()
    return rows


class NothingEncoded(UserError):
    """Every image of the source was skipped: the shards hold nothing worth keeping."""


def run_extraction(cfg: ExtractConfig, ctx: DistContext | None = None) -> ExtractResult:
    """Encodes this process's missing shards; process 0 then writes manifest + report if all exist."""
    ctx = ctx or DistContext()
    for name in ("image_size", "shard_size", "batch_size", "max_shards"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if cfg.scaling_factor is not None and not (math.isfinite(cfg.scaling_factor) and cfg.scaling_factor > 0):
        raise UserError(f"--scaling-factor {cfg.scaling_factor} must be a positive finite number (SD's VAE: 0.18215)")
    data, out = Path(cfg.data_path).resolve(), Path(cfg.out).resolve()
    if data.is_dir() and (out == data or data in out.parents):
        raise UserError(f"--out {cfg.out} lies inside --data-path {cfg.data_path}: the latents would be written "
                        "into the image tree (and read as images next time); pick a folder outside it")
    if cfg.vae_dtype not in DTYPES:
        raise UserError(f"--vae-dtype must be one of {', '.join(DTYPES)}, got {cfg.vae_dtype}")
    if cfg.vae_dtype != "fp32" and ctx.device.type != "cuda":
        raise UserError(f"--vae-dtype {cfg.vae_dtype} is for GPUs; on {ctx.device.type} the VAE runs in fp32 "
                        "(drop the flag)")
    images = open_source(cfg.data_path, cfg.data_format, cfg.image_column, cfg.label_column)
    if not images.files:
        raise UserError(f"--data-path {cfg.data_path} holds no images ({images.format}: 0 rows); "
                        "pass the dataset's folder or files that hold its images")
    vae = load_vae(cfg.vae, ctx.device, DTYPES[cfg.vae_dtype], cfg.scaling_factor)
    if cfg.image_size % vae.downsample:
        raise UserError(f"--image-size {cfg.image_size} is not a multiple of the VAE's downsampling factor "
                        f"{vae.downsample}; use e.g. {max(1, round(cfg.image_size / vae.downsample)) * vae.downsample}")
    latent_shape = (vae.latent_channels, cfg.image_size // vae.downsample, cfg.image_size // vae.downsample)
    out = Path(cfg.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _extract_into(out, cfg, ctx, images, vae, latent_shape)
    except UserError as err:
        # A refused first batch, or shards of no image at all, leave no --out behind; finished
        # shards of images are kept for the rerun.
        if created and ctx.rank == 0 and (isinstance(err, NothingEncoded) or not any(out.glob("shard-*"))):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _extract_into(out: Path, cfg: ExtractConfig, ctx: DistContext, images: ImageSource, vae: LoadedVAE,
                  latent_shape: tuple[int, int, int]) -> ExtractResult:
    """The encoding itself, into the existing folder `out` (run_extraction's checks passed)."""
    num_files = len(images.files)
    num_shards = math.ceil(num_files / cfg.shard_size)
    fingerprint = _fingerprint(cfg, images, vae)
    _check_compatible(out, fingerprint, num_shards)

    # Shards with a checksum file are claimed done; the rest, and the hashing of the claimed ones (a claim
    # failing its checksum is redone by its checker), are split round-robin. Every process looks at the folder
    # before any writes, so all agree; splitting only what is left keeps a resumed run balanced.
    claimed = [k for k in range(num_shards) if checksum_path(out / shard_file_name(k)).is_file()]
    ctx.barrier()
    todo = sorted(set(range(num_shards)) - set(claimed))
    to_check = claimed[ctx.rank::ctx.world]
    reused = [k for k in to_check if shard_is_complete(out / shard_file_name(k))]
    pending = sorted(todo[ctx.rank::ctx.world] + sorted(set(to_check) - set(reused)))[: cfg.max_shards]
    plan = []  # (shard, positions, last batch of its shard) for every batch; batches never cross shards
    for k in pending:
        positions = list(range(k * cfg.shard_size, min((k + 1) * cfg.shard_size, num_files)))
        chunks = [positions[i:i + cfg.batch_size] for i in range(0, len(positions), cfg.batch_size)]
        plan += [(k, chunk, i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    if ctx.rank == 0:
        print(f"{num_files} images in {len(images.class_names)} classes -> {num_shards} shards of <= "
              f"{cfg.shard_size} in {out}; latents {list(latent_shape)} on {ctx.device} ({cfg.vae_dtype}), "
              f"{ctx.world} process(es); process 0: {len(pending)} to write, {len(reused)} already done", flush=True)

    loader = DataLoader(images.images(cfg.image_size, cfg.min_side), batch_sampler=[p for _, p, _ in plan],
                        num_workers=cfg.num_workers, collate_fn=list)
    bar = tqdm(total=sum(len(p) for _, p, _ in plan), unit="img", disable=ctx.rank != 0, smoothing=0.1,
               desc=f"encoding (process 0 of {ctx.world})")
    # A shard of no image (so that it has shapes), onto which each shard's batches are concatenated.
    latents, rows = torch.zeros((0, 2, *latent_shape), dtype=torch.float16), torch.zeros(0, dtype=torch.int64)
    empty = {"mean": latents, "std": latents, "label": rows, "index": rows}
    if cfg.keep_images:
        empty[IMAGE_KEY] = torch.zeros((0, 3, cfg.image_size, cfg.image_size), dtype=torch.uint8)
    written: list[int] = []
    batches, report = [], []
    for (shard, positions, last), items in zip(plan, loader):
        report += [[it.position, images.files[it.position], it.action, it.detail] for it in items if it.action != "ok"]
        batches.append(_encode_batch(vae, items, images, cfg.keep_images))
        bar.update(len(positions))
        if last:
            tensors = {k: torch.cat([v, *(b[k] for b in batches if b)]) for k, v in empty.items()}
            meta = {"shard": shard, "count": len(tensors["label"]), "extraction": fingerprint, "report": report,
                    "stats": moment_sums(tensors["mean"].numpy(), tensors["std"].numpy())}
            write_shard(out, shard, tensors, meta)
            written.append(shard)
            bar.set_postfix(shards=f"{len(written)}/{len(pending)}")
            batches, report = [], []
    bar.close()

    ctx.barrier()
    manifest = write_manifest(out, cfg, images, vae, latent_shape, fingerprint, num_shards) if ctx.rank == 0 else None
    return ExtractResult(num_shards, written, reused, manifest)


def write_manifest(out: Path, cfg: ExtractConfig, images: ImageSource, vae: LoadedVAE,
                   latent_shape: tuple[int, int, int], fingerprint: dict[str, Any], num_shards: int) -> Path | None:
    """Writes manifest.json + the report when every shard is present (else says what is missing), with the
    checksums of the shards' checksum files (hashed when written or verified when reused)."""
    shards, report, missing, stats = [], [], [], []
    for k in range(num_shards):
        path = out / shard_file_name(k)
        digest, meta = read_checksum(path), read_shard_meta(path)
        if digest is None or meta is None:
            missing.append(path.name)
            continue
        shards.append({"file": path.name, "count": int(meta["count"]), "sha256": digest})
        report += meta["report"]
        if not meta.get("stats"):  # a shard written before shards carried their sums (a resumed older extraction)
            tensors = load_file(str(path))
            meta["stats"] = moment_sums(tensors["mean"].numpy(), tensors["std"].numpy())
        stats.append(meta["stats"])
    if missing:
        print(f"{len(missing)} of {num_shards} shards not written yet (first: {missing[0]}); "
              "rerun the same command to finish (finished shards are kept)", flush=True)
        return None
    remove_stale_tmp(out)
    lines = ["index\tpath\taction\tdetail"] + ["\t".join(str(v) for v in row) for row in report]
    write_atomic(out / REPORT_NAME, ("\n".join(lines) + "\n").encode())
    num_images = sum(s["count"] for s in shards)
    if not num_images:  # no manifest: a latent folder of no images must not look finished
        first = next((row for row in report if row[2] == "skipped"), None)
        raise NothingEncoded(f"none of the {len(images.files)} images of {cfg.data_path} could be encoded: every one "
                             f"was skipped{f' (first: {first[1]}: {first[3]})' if first else ''}; fix or replace "
                             "the images")
    channel_mean, channel_std = channel_statistics(stats)
    manifest = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "num_images": num_images, "num_files": len(images.files),
        "num_skipped": sum(1 for row in report if row[2] == "skipped"),
        "num_converted": sum(1 for row in report if row[2] == "converted"),
        "num_shards": num_shards, "shard_size": cfg.shard_size, "latent_shape": list(latent_shape), "dtype": "float16",
        # per channel, of the posterior samples over all images and flips (data.latent_norm=channel)
        "channel_mean": channel_mean, "channel_std": channel_std,
        "tensors": {"mean": "(n, 2, C, h, w) posterior mean * scaling_factor; [:, 1] = flipped image",
                    "std": "(n, 2, C, h, w) posterior std * scaling_factor",
                    "label": "(n,) class index", "index": "(n,) position in the sorted file list",
                    **({IMAGE_KEY: "(n, 3, S, S) uint8 centre crop the VAE encoded (unflipped)"} if cfg.keep_images
                       else {})},
        "images": cfg.keep_images, "vae": vae.name, "vae_dtype": cfg.vae_dtype,
        "scaling_factor": vae.scaling_factor, "shift_factor": vae.shift_factor,
        "image_size": cfg.image_size, "crop": "adm_center_crop", "flip": True,
        "data_path": str(cfg.data_path), "source": {"format": images.format, "path": images.path, **images.options},
        "num_classes": len(images.class_names), "class_names": images.class_names, "report": REPORT_NAME,
        "extraction": fingerprint, "shards": shards,
    }
    path = out / MANIFEST_NAME
    write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    print(f"wrote {num_images} images ({manifest['num_skipped']} skipped, {manifest['num_converted']} converted; see "
          f"{out / REPORT_NAME}) in {num_shards} shards; manifest {path}", flush=True)
    return path
