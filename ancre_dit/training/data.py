"""Data adapters for training (digits, latents, images) and the resumable data order.

The order of samples is a pure function of (seed, epoch), and checkpoints save (epoch, offset), so a
resumed run reads exactly the batches the straight run would. All per-sample randomness (flips,
posterior draws) happens in the training step from the trainer's saved generator, not in workers.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ..errors import UserError
from ..data.image_folder import list_image_folder, load_rgb
from ..data.latent_norm import ChannelNorm, latent_norm_from_manifest
from ..models import DIT_MODELS
from .config_sections import Config
from .stopping import worker_signal_handlers


@dataclass
class DataInfo:
    """What the model and the checkpoint spec need to know about the data."""
    dataset: Dataset
    kind: str
    input_size: int          # spatial size the model sees (latent side for latents)
    in_channels: int
    num_classes: int
    image_size: int          # pixels of the decoded image
    image_channels: int
    vae: str | None = None
    scaling_factor: float | None = None
    random_flip: bool = False
    heldout: Dataset | None = None   # fixed held-out examples of the evaluation's held-out loss
    latents: Any = None              # the LatentShardDataset behind `dataset` (latents only)
    latent_norm: ChannelNorm | None = None  # data.latent_norm=channel: applied to every posterior draw


class _ImageFolderArrays(Dataset):
    """A class-folder tree -> (float32 (3, S, S) in [-1, 1], label), ADM's center crop (the trainer flips)."""

    def __init__(self, root: str, image_size: int):
        self.images = list_image_folder(root, require_classes=True)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.images.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        arr = load_rgb(self.images.root / self.images.files[i], self.image_size).astype(np.float32)
        return torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0, self.images.labels[i]


def check_data_path(config: Config, found: Callable[..., bool]) -> None:
    """At config load: the data folder of a latents or images run and the held-out latents
    (`found(key, path, "dir")`: whether it exists, or counts as found where paths are not checked)."""
    d, e = config.data, config.eval
    if d.kind in ("latents", "images"):
        what = "latent directory" if d.kind == "latents" else "image folder"
        if not d.path:
            raise UserError(f"data.kind={d.kind} needs data.path (the {what})")
        if d.kind == "latents" and Path(d.path).is_file():
            from ..data.latent_shards import read_manifest
            read_manifest(d.path)  # its one line on a file given for the folder
        if not found("data.path", d.path, "dir"):
            where = ("directory written by scripts/extract_latents.py" if d.kind == "latents"
                     else "ImageFolder root (one folder per class)")
            raise UserError(f"data path {d.path} does not exist; set data.path to the {where}")
    if (e.heldout_from_train or e.val_path) and d.kind != "latents":
        raise UserError("eval.val_path and eval.heldout_from_train apply to data.kind=latents only "
                        "(digits use their held-out split); remove them")
    if e.val_path and e.heldout_from_train:
        raise UserError("set eval.val_path or eval.heldout_from_train, not both")
    if e.val_path and not found("eval.val_path", e.val_path, "dir"):
        raise UserError(f"eval.val_path {e.val_path} does not exist; point it at a latent directory "
                        f"written by scripts/extract_latents.py")


def check_batch_layout(config: Config, num_processes: int) -> int:
    """Per-device micro-batch = global batch / (processes x accumulation); a UserError if it does not divide."""
    t = config.train
    parts = num_processes * t.grad_accum
    if t.global_batch_size % parts:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by {num_processes} "
                        f"process(es) x {t.grad_accum} accumulation step(s) = {parts}; choose a multiple of {parts}")
    return t.global_batch_size // parts


def build_data(config: Config, patch_size: int | None = None) -> DataInfo:
    """Opens config.data's dataset, checking that the model's patch size (default: config.model.name's) divides it."""
    d = config.data
    if patch_size is None:
        patch_size = config.model.patch_size or DIT_MODELS[config.model.name][1]
    if d.kind == "digits":
        from ..data.digits import DIGITS_NUM_CLASSES, DigitsDataset
        info = DataInfo(DigitsDataset("train"), "digits", 8, 1, DIGITS_NUM_CLASSES, 8, 1,
                        heldout=DigitsDataset("heldout"))
        if d.image_size != 8:
            raise UserError(f"the digits are 8x8 pixels; set data.image_size=8 (got {d.image_size})")
    elif d.kind == "latents":
        from ..data.latent_shards import LatentShardDataset
        # data.in_memory is loaded by load_latents_in_memory, once per node.
        ds = LatentShardDataset(d.path, images=config.repa.weight > 0)
        c, h, w = ds.latent_shape
        m = ds.manifest
        if int(m["image_size"]) != d.image_size:
            raise UserError(f"the latents in {d.path} were extracted at {m['image_size']} px but data.image_size="
                            f"{d.image_size}; set data.image_size={m['image_size']}")
        if d.vae:
            from ..vae import check_vae_fits
            check_vae_fits(d.vae, ds.latent_shape, int(m["image_size"]))
        train_set, heldout = _split_latents(ds, config)
        info = DataInfo(train_set, "latents", h, c, ds.num_classes, int(m["image_size"]), 3,
                        vae=d.vae or m.get("vae"), scaling_factor=float(m["scaling_factor"]), heldout=heldout,
                        latents=ds, latent_norm=latent_norm_from_manifest(d.latent_norm, m, f"{d.path}/manifest.json"))
    else:
        ds = _ImageFolderArrays(d.path, d.image_size)
        info = DataInfo(ds, "images", d.image_size, 3, len(ds.images.class_names), d.image_size, 3, random_flip=True)
    if d.latent_norm != "scale" and info.kind != "latents":
        raise UserError(f"data.latent_norm={d.latent_norm} applies to VAE latents; data.kind={d.kind} trains on "
                        "pixels (drop data.latent_norm)")
    if info.input_size % patch_size:
        what = "latent side" if info.kind == "latents" else "data.image_size"
        owner = "model.patch_size" if config.model.patch_size else config.model.name
        raise UserError(f"{what} {info.input_size} is not divisible by the patch size {patch_size} of {owner}; pick "
                        "a model or a model.patch_size that divides it")
    return info


def check_enough_samples(num_samples: int, global_batch: int, where: str) -> None:
    """A training set that fills at least one global batch (an incomplete last batch is dropped)."""
    if num_samples == 0:
        raise UserError(f"the training data ({where}) holds no samples; point data.path at a dataset with images "
                        "(for latents: the --out folder of a finished extract_latents.py)")
    if num_samples < global_batch:
        raise UserError(f"the training data ({where}) holds {num_samples} samples, fewer than one batch of "
                        f"train.global_batch_size={global_batch}; set train.global_batch_size to at most "
                        f"{num_samples}, or train on more data")


def load_latents_in_memory(info: DataInfo, accelerator, run_dir: Path) -> None:
    """data.in_memory: one copy of the latents per node. The node's first rank fills files in /dev/shm,
    the others map them, and the names are removed once all have (a crash leaves nothing behind). All
    ranks refuse together when any node lacks the memory (no rank is left waiting in a collective)."""
    ds = info.latents
    problem = ds.memory_problem()
    if accelerator.num_processes == 1:
        if problem:
            raise UserError(problem)
        ds.load_into_memory()
        return
    refusals = accelerator.reduce(torch.tensor([float(problem is not None)], device=accelerator.device), "sum")
    if refusals.item():  # start-up, not the step loop: one host read is fine here
        raise UserError(problem or f"data.in_memory: the latents of {ds.root} do not fit in the free memory of "
                                   f"another node of this job; set data.in_memory=false")
    from ..data.latent_shards import shared_memory_dir

    shm = shared_memory_dir()
    key = hashlib.sha1(f"{Path(run_dir).resolve()}|{Path(ds.root).resolve()}".encode()).hexdigest()[:16]
    backing = shm / f"ancre-dit-latents-{key}"
    first = accelerator.is_local_main_process
    try:
        if first:
            ds.load_into_memory(backing, fill=True)
        accelerator.wait_for_everyone()
        if not first:
            ds.load_into_memory(backing, fill=False)
        accelerator.wait_for_everyone()
    finally:  # the mappings stay; the names go, whatever happened
        if first:
            for part in shm.glob(f"{backing.name}.*"):
                part.unlink(missing_ok=True)


def _split_latents(ds, config: Config) -> tuple[Dataset, Dataset | None]:
    """(training set, held-out set): eval.val_path's latents, or the last eval.heldout_from_train
    training latents, which training then skips."""
    e = config.eval
    if e.val_path:
        from ..data.latent_shards import LatentShardDataset
        val = LatentShardDataset(e.val_path)
        if val.latent_shape != ds.latent_shape or val.num_classes != ds.num_classes:
            raise UserError(f"eval.val_path {e.val_path} holds {val.latent_shape} latents of {val.num_classes} "
                            f"classes, the training data {ds.latent_shape} of {ds.num_classes}; extract both the "
                            f"same way")
        return ds, val
    k = e.heldout_from_train
    if k:
        if k >= len(ds):
            raise UserError(f"eval.heldout_from_train={k} leaves no training data ({len(ds)} latents); lower it")
        return _SubsetBatches(ds, range(len(ds) - k)), Subset(ds, range(len(ds) - k, len(ds)))
    return ds, None


def prepare_batch(info: DataInfo, batch: tuple, device: torch.device, generator: torch.Generator,
                  clean_images: bool = False) -> tuple[torch.Tensor, ...]:
    """A batch on `device` with the step's augmentation from `generator` (flip + posterior draw for latents, a flip
    for image folders) -> (x, y), with `clean_images` (REPA) also the clean image in [0, 255], flipped as x is."""
    x, y, *stored = batch  # latents read with their clean images: (moments, labels, images)
    x, y, images = x.to(device, non_blocking=True), y.to(device, non_blocking=True), None
    if info.kind == "latents":
        from ..data.latent_shards import draw_latents_from_moments
        x, flip = draw_latents_from_moments(x, generator=generator, return_flip=True)
        if info.latent_norm is not None:
            x = info.latent_norm(x)
        if clean_images:
            if not stored:
                raise UserError("REPA needs the clean images, but the latent loader gave none; open the latents "
                                "with their images (build_data with repa.weight > 0)")
            images = stored[0].to(device, non_blocking=True)
            images = torch.where(flip.bool()[:, None, None, None], images.flip(-1), images).float()
    elif info.random_flip:
        flip = torch.rand(x.shape[0], generator=generator, device=generator.device).to(device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if clean_images and info.kind != "latents":
        images = (x.float() + 1.0) * 127.5  # the training example in [-1, 1] is the clean image
    return (x.float(), y.long(), images) if clean_images else (x.float(), y.long())


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Infinite stream of this rank's micro-batches, starting at (epoch, offset). Epoch e is `randperm(n)` seeded
    by (seed, e); global batch s covers positions [s*B, (s+1)*B) of it (an incomplete last one is dropped); rank r
    takes the r-th of `world` slices, cut into `accum` micro-batches: the same batches whatever the layout."""

    def __init__(self, num_samples: int, global_batch: int, world: int, rank: int, accum: int, seed: int,
                 epoch: int = 0, offset: int = 0):
        check_enough_samples(num_samples, global_batch, "the sampler's dataset")
        self.n, self.B, self.rank, self.accum, self.seed = num_samples, global_batch, rank, accum, seed
        self.micro = global_batch // (world * accum)
        self.epoch, self.offset = epoch, offset

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.offset // self.B
        while True:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            for s in range(start, self.n // self.B):
                base = s * self.B + self.rank * self.micro * self.accum
                for k in range(self.accum):
                    yield perm[base + k * self.micro: base + (k + 1) * self.micro].tolist()
            epoch, start = epoch + 1, 0


def advance_position(epoch: int, offset: int, global_batch: int, num_samples: int) -> tuple[int, int]:
    """(epoch, offset) after one optimizer step; mirrors GlobalBatchSampler's epoch boundary."""
    offset += global_batch
    if offset + global_batch > num_samples:  # the next global batch would be incomplete: a new epoch
        return epoch + 1, 0
    return epoch, offset


def collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.tensor([int(y) for y in ys])


class _BatchReads(Dataset):
    """`reads[indices]` -> `dataset.get_batch(indices)`: the DataLoader (batch_size=None) hands each
    worker a whole micro-batch, which the latent shards read in one pass per file."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        return self.dataset.get_batch(indices)


class _SubsetBatches(Subset):
    """A Subset that keeps its dataset's batched read (eval.heldout_from_train's training part)."""

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        return self.dataset.get_batch([self.indices[i] for i in indices])


def make_loader(info: DataInfo, sampler: GlobalBatchSampler, num_workers: int, pin_memory: bool
                ) -> torch.utils.data.DataLoader:
    """The training DataLoader over `sampler`'s micro-batches ((x, y), REPA's images third), a micro-batch per call
    where the dataset has `get_batch` (the latent shards). Its private generator: DataLoader would otherwise seed
    its workers from the global RNG (label dropout's) and break exact resume."""
    workers = num_workers > 0
    common = dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=workers,
                  generator=torch.Generator(), prefetch_factor=4 if workers else None,
                  worker_init_fn=worker_signal_handlers if workers else None)
    if hasattr(info.dataset, "get_batch"):
        return torch.utils.data.DataLoader(_BatchReads(info.dataset), sampler=sampler, batch_size=None, **common)
    return torch.utils.data.DataLoader(info.dataset, batch_sampler=sampler, collate_fn=collate, **common)


def nonfinite_rows(info: DataInfo, global_batch: int, seed: int, position: tuple[int, int]) -> str:
    """Which samples of the global batch at `position` = (epoch, offset) hold non-finite values (shard
    file and row for latents), read again for the non-finite guard's report."""
    dataset = info.dataset
    describe = getattr(dataset, "describe_row", lambda i: f"sample {i}")  # latent shards name file and row
    batch = next(iter(GlobalBatchSampler(len(dataset), global_batch, 1, 0, 1, seed, *position)))
    found = [describe(i) for i in batch if not torch.isfinite(torch.as_tensor(dataset[i][0]).float()).all()]
    if not found:
        return "its stored rows are finite: the non-finite values arose after reading them"
    return "non-finite data: " + ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
