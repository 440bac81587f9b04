"""Training-side reader of the VAE latent shards written by scripts/extract_latents.py.

LATENT_DIR holds `manifest.json` and `shard-XXXXX.safetensors`, each with `mean`, `std` float16 (n, 2, C, h, w)
(index 1 of dim 1: the flipped image; both times the VAE scaling factor), `label` and `index` int64 (n,)
(position in the sorted file list) and, with `--keep-images`, `image` uint8 (n, 3, S, S), the unflipped crop
the VAE encoded (REPA's encoder input). Training draws a fresh posterior sample per step.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..errors import UserError
from ..files import file_problem

FORMAT_NAME = "ancre-dit-latents"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REPORT_NAME = "extraction_report.tsv"
SHARD_KEYS = ("mean", "std", "label", "index")
IMAGE_KEY = "image"  # optional: the clean image (extract_latents.py --keep-images)


def shard_file_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


# safetensors dtype -> (numpy dtype the bytes are read as, torch dtype); bfloat16's bytes are read as uint16.
_DTYPES = {"F16": (np.dtype("<f2"), torch.float16), "BF16": (np.dtype("<u2"), torch.bfloat16),
           "F32": (np.dtype("<f4"), torch.float32), "I64": (np.dtype("<i8"), torch.int64),
           "U8": (np.dtype("u1"), torch.uint8)}


class _ShardFile:
    """An open shard read by positional reads straight into the batch buffer: no per-call Python
    objects as with safetensors' `get_slice`, no page faults as with re-created maps."""

    def __init__(self, path: Path, layout: tuple[int, dict]):
        start, tensors = layout
        self.torch_dtype = _DTYPES[tensors["std"][0]][1]
        self.offsets, self.row_bytes = {}, {}
        for name in ("mean", "std", IMAGE_KEY):
            if name in tensors:
                _, shape, begin, end = tensors[name]
                self.offsets[name], self.row_bytes[name] = start + begin, (end - begin) // max(shape[0], 1)
        self.fd = os.open(path, os.O_RDONLY)
        dtype, _, begin, end = tensors["label"]
        self.labels = np.frombuffer(os.pread(self.fd, end - begin, start + begin), _DTYPES[dtype][0]).astype(np.int64)

    def read_row(self, name: str, row: int, halves: list[memoryview]) -> None:
        """Reads row `row` of tensor `name` into `halves`, filled in order."""
        os.preadv(self.fd, halves, self.offsets[name] + row * self.row_bytes[name])

    def read_all(self, name: str) -> np.ndarray:
        """Every row of tensor `name` as bytes, uint8 (rows, row bytes)."""
        data = os.pread(self.fd, self.row_bytes[name] * len(self.labels), self.offsets[name])
        return np.frombuffer(data, np.uint8).reshape(len(self.labels), -1)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        self.close()


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Loads LATENT_DIR/manifest.json; anything missing or foreign is one clear UserError."""
    root = Path(root)
    path = root / MANIFEST_NAME
    hint = ("run scripts/extract_latents.py --data-path IMAGES --vae VAE_DIR --out "
            f"{root} (rerun the same command to finish an interrupted extraction), then check it with "
            f"scripts/extract_latents.py --verify {root}")
    if root.is_file():
        raise UserError(f"{root} is a file; data.path names the latent folder that holds {MANIFEST_NAME} and the "
                        f"shards: set data.path={root.parent if root.name == MANIFEST_NAME else 'LATENT_DIR'}")
    if not root.is_dir():
        raise UserError(f"latent directory {root} does not exist; {hint}")
    if not path.is_file():
        raise UserError(f"{root} has no {MANIFEST_NAME} (not a latent directory, or its extraction did not "
                        f"finish); {hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not a {FORMAT_NAME} manifest; {hint}")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(f"{path} has format version {manifest.get('version')}, this code reads "
                         f"version {FORMAT_VERSION}; re-extract the latents with this version")
    factor = manifest.get("scaling_factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise UserError(f"{path} has scaling_factor {factor!r}, not a positive finite number; the manifest is "
                        f"damaged or edited: {hint}")
    return manifest


def _check_shards_match(root: Path, shards: list[dict], latent_shape: tuple[int, int, int],
                        image_shape: tuple[int, int, int] | None) -> dict[str, tuple[int, dict]]:
    """Each shard listed once, readable, its header holding `count` rows of the manifest's latent shape (and
    of clean images, with `image_shape`), checked up front rather than failing in a DataLoader worker.
    Returns each file's header layout (data start, {name: (dtype, shape, begin, end)}) for the reads."""
    fix = f"run scripts/extract_latents.py --verify {root}, then re-extract the latents"
    files = [s["file"] for s in shards]
    if twice := sorted({f for f in files if files.count(f) > 1}):
        raise UserError(f"{root}/{MANIFEST_NAME} lists {twice[0]} twice (its images would be trained on twice); {fix}")
    layouts = {}
    for s in shards:
        path, count = root / s["file"], int(s["count"])
        if problem := file_problem(path):
            raise UserError(f"latent shard {problem}; run scripts/extract_latents.py --verify {root}, "
                            "then rerun the extraction to rewrite it")
        with open(path, "rb") as f:  # by hand: the positional reads need the byte offsets
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        tensors = {name: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for name, v in header.items()}
        layouts[s["file"]] = 8 + size, tensors
        for name in ("mean", "std", "label"):
            if name not in tensors:
                raise UserError(f"latent shard {path} holds no {name!r} tensor; {fix}")
            if tensors[name][0] not in _DTYPES:
                raise UserError(f"{path}: tensor {name} has dtype {tensors[name][0]}, which this reader does not "
                                "know; re-extract the latents")
        shape = tensors["mean"][1]
        if len(shape) != 5 or tuple(shape[2:]) != latent_shape:
            raise UserError(f"latent shard {path} holds latents of shape {tuple(shape[2:])}, the manifest "
                            f"says {latent_shape} (another extraction's shard?); {fix}")
        rows = [tuple(tensors[name][1])[:1] for name in ("mean", "std", "label")]
        if any(r != (count,) for r in rows):
            rows = min((r[0] if r else 0) for r in rows)
            raise UserError(f"latent shard {path} holds {rows} rows, its manifest entry says {count}; {fix}")
        if image_shape is not None:
            dtype, shape = tensors[IMAGE_KEY][:2] if IMAGE_KEY in tensors else (None, None)
            if dtype != "U8" or shape != (count, *image_shape):
                raise UserError(f"latent shard {path}: image is {dtype} {shape}, expected uint8 "
                                f"{(count, *image_shape)}; re-extract the latents with --keep-images")
    return layouts


class LatentShardDataset(Dataset):
    """Random access over all images of a latent directory.

    `ds.get_batch(indices) -> (moments (N, 2, 2, C, h, w) [flip][mean, std], labels int64 (N,))`, read shard by
    shard (the loader calls it once per micro-batch); `ds[i]` is the same for one index. Shards are opened lazily,
    at most `max_open_shards` per process. `in_memory=True` first reads every shard into shared memory (refused
    in one line when it does not fit). `images=True` (REPA; --keep-images shards) adds the clean images uint8
    (N, 3, S, S) third to `get_batch`'s result; `ds[i]` stays the moments only.
    """

    def __init__(self, root: str | os.PathLike, max_open_shards: int = 64, in_memory: bool = False,
                 images: bool = False):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.num_classes: int = int(self.manifest["num_classes"])
        self.latent_shape: tuple[int, int, int] = tuple(int(s) for s in self.manifest["latent_shape"])
        shards = self.manifest["shards"]
        if missing := [s["file"] for s in shards if not (self.root / s["file"]).is_file()]:
            raise UserError(f"{self.root} lacks {len(missing)} shard(s) listed in its manifest "
                             f"(first: {missing[0]}); run scripts/extract_latents.py --verify {self.root}, "
                             "then rerun the extraction to rewrite them")
        self.images = images
        self.image_shape: tuple[int, int, int] | None = None
        if images:
            size = int(self.manifest["image_size"])
            if not self.manifest.get("images"):
                raise UserError(f"latent directory {self.root} holds no images (extracted without --keep-images), "
                                f"but REPA (repa.weight > 0) aligns with the clean images; re-extract with "
                                f"scripts/extract_latents.py --keep-images (about {3 * size * size / 1000:.0f} KB per "
                                f"{size}px image), or set repa.weight=0")
            self.image_shape = (3, size, size)
        layouts = _check_shards_match(self.root, shards, self.latent_shape, self.image_shape)
        nonempty = [s for s in shards if int(s["count"]) > 0]
        self._files = [self.root / s["file"] for s in nonempty]
        self._layouts = [layouts[s["file"]] for s in nonempty]  # headers, kept: a few hundred bytes per shard
        ends = np.cumsum([0] + [int(s["count"]) for s in nonempty])
        self._starts, self._len = ends[:-1], int(ends[-1])
        if self._len != int(self.manifest["num_images"]):
            raise UserError(f"{self.root}/{MANIFEST_NAME} lists {self._len} images in its shards but "
                             f"num_images={self.manifest['num_images']}; run --verify and re-extract")
        self._dtype = _DTYPES[self._layouts[0][1]["mean"][0] if self._len else "F16"][1]  # the first shard's
        self._max_open = max(1, max_open_shards)
        self._files_open: OrderedDict[int, _ShardFile] = OrderedDict()
        self._memory: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        if in_memory and (problem := self.memory_problem()):
            raise UserError(problem)
        if in_memory:
            self.load_into_memory()

    def __len__(self) -> int:
        return self._len

    def describe_row(self, i: int) -> str:
        """Where global image `i` is stored, for messages: "<shard file> row <row>"."""
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} latents")
        i %= self._len
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        return f"{self._files[shard].name} row {i - self._starts[shard]}"

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        moments, labels = self.get_batch([int(i)], shared=False)[:2]  # a sample, collated later: no shared tensor
        return moments[0], int(labels[0])

    def _shard_file(self, shard: int) -> _ShardFile:
        """The shard opened for reads (the least recently used one closed beyond `max_open_shards`); its
        moments must be stored in the first shard's dtype."""
        entry = self._files_open.get(shard)
        if entry is None:
            entry = self._files_open[shard] = _ShardFile(self._files[shard], self._layouts[shard])
            if len(self._files_open) > self._max_open:
                self._files_open.popitem(last=False)[1].close()
        else:
            self._files_open.move_to_end(shard)
        if entry.torch_dtype != self._dtype:
            raise UserError(f"{self._files[shard]} stores {entry.torch_dtype}, other shards {self._dtype}; "
                            "re-extract the latents")
        return entry

    def get_batch(self, indices: Sequence[int], shared: bool = True) -> tuple[torch.Tensor, ...]:
        """`(stack of ds[i][0], tensor of ds[i][1])` over `indices` (with `images`, their clean images third);
        with `shared`, allocated in shared memory inside a DataLoader worker, as default_collate does."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if (bad := idx[(idx < -self._len) | (idx >= self._len)]).size:
            raise IndexError(f"index {bad[0]} out of range for {self._len} latents")
        idx, n = idx % max(self._len, 1), len(idx)
        images = _new_batch_tensor((n, *self.image_shape), torch.uint8, shared) if self.images else None
        moments = _new_batch_tensor((n, 2, 2, *self.latent_shape), self._dtype, shared)
        if self._memory is not None:
            all_moments, all_labels, all_images = self._memory
            picked = torch.from_numpy(idx)
            torch.index_select(all_moments, 0, picked, out=moments)
            labels = all_labels[picked]
            if images is not None:
                torch.index_select(all_images, 0, picked, out=images)
        else:
            labels = self._read_rows(idx, moments, images)
        return (moments, labels) if images is None else (moments, labels, images)

    def _read_rows(self, idx: np.ndarray, moments: torch.Tensor, images: torch.Tensor | None) -> torch.Tensor:
        """Reads rows `idx` into `moments` (and `images`) shard by shard in file order, each shard
        opened at most once per batch; returns their labels."""
        n = len(idx)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        rows = idx - self._starts[shard_of]
        labels = torch.empty(n, dtype=torch.int64)
        # [sample, flip, mean/std, bytes]
        raw = moments.view(torch.uint8).numpy().reshape(n, 2, 2, moments[0, 0, 0].nbytes if n else 0)
        image_rows = images.numpy().reshape(n, int(np.prod(self.image_shape))) if images is not None else None
        label_out = labels.numpy()
        shard_list, row_list = shard_of.tolist(), rows.tolist()
        for shard, group in itertools.groupby(np.lexsort((rows, shard_of)).tolist(), key=shard_list.__getitem__):
            f = self._shard_file(shard)
            for k in group:
                row = row_list[k]
                f.read_row("mean", row, [raw[k, 0, 0], raw[k, 1, 0]])
                f.read_row("std", row, [raw[k, 0, 1], raw[k, 1, 1]])
                if image_rows is not None:
                    f.read_row(IMAGE_KEY, row, [image_rows[k]])
                label_out[k] = f.labels[row]
        return labels

    def memory_problem(self) -> str | None:
        """Why one in-memory copy of the latents does not fit (None: it fits) in free memory, the job's cgroup
        limit or the shared-memory filesystem (a container's /dev/shm)."""
        need = self._len * 4 * int(np.prod(self.latent_shape)) * self._dtype.itemsize
        need += self._len * int(np.prod(self.image_shape)) if self.images else 0
        shm = shared_memory_dir()
        room = [(available_memory_bytes(), "of memory is available", "set data.in_memory=false"),
                (cgroup_memory_left(), "the job's memory limit leaves (cgroup memory.max: SLURM --mem, a "
                 "container's --memory)", "raise the limit or set data.in_memory=false"),
                (shutil.disk_usage(shm).free, f"is free in {shm}, the shared-memory filesystem",
                 "give it more (a container's --shm-size) or set data.in_memory=false")]
        for free, where, fix in room:
            if free is not None and need > 0.9 * free:
                return (f"data.in_memory needs {_size(need)} for the latents of {self.root} but only "
                        f"{_size(free)} {where}; {fix} (the shards are then read from disk)")
        return None

    def load_into_memory(self, backing: Path | None = None, fill: bool = True) -> None:
        """Reads every shard once into arrays that batches are picked from: this process's shared memory (its
        workers see it without a copy), or with `backing`, a path prefix on a memory filesystem, files mapped
        shared by every process of a node that maps it (one copy per node); `fill=False` maps arrays another filled."""
        def array(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if backing is None:
                return torch.empty(shape, dtype=dtype).share_memory_()
            return torch.from_file(f"{backing}.{name}", shared=True, size=int(np.prod(shape)), dtype=dtype).view(shape)

        moments = array("moments", (self._len, 2, 2, *self.latent_shape), self._dtype)
        images = array("images", (self._len, *self.image_shape), torch.uint8) if self.images else None
        labels = array("labels", (self._len,), torch.int64)
        if fill:
            flat = moments.view(torch.uint8).numpy().reshape(self._len, 2, 2, -1)  # [image, flip, mean/std, bytes]
            for shard in tqdm(range(len(self._files)), desc="latents into memory", unit="shard", dynamic_ncols=True):
                f = self._shard_file(shard)
                start, end = int(self._starts[shard]), int(self._starts[shard]) + len(f.labels)
                for which, name in enumerate(("mean", "std")):
                    flat[start:end, :, which] = f.read_all(name).reshape(end - start, 2, -1)
                if images is not None:
                    images.numpy()[start:end] = f.read_all(IMAGE_KEY).reshape(end - start, *self.image_shape)
                labels[start:end] = torch.from_numpy(f.labels)
            for entry in self._files_open.values():
                entry.close()
            self._files_open.clear()
        self._memory = moments, labels, images

    def __getstate__(self) -> dict[str, Any]:  # open handles stay behind: each (spawned) worker reopens lazily
        return {**self.__dict__, "_files_open": OrderedDict()}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def shared_memory_dir() -> Path:
    """Where shared memory lives: /dev/shm on Linux (torch's shared tensors too), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


# cgroup v2 (memory.max, memory.current) or v1 (memory/memory.limit_in_bytes, memory.usage_in_bytes)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory_left() -> int | None:
    """Bytes this process's memory cgroup still allows (limit less usage); None without a readable limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (CGROUP_ROOT / limit_file).read_text().strip()
            usage = int((CGROUP_ROOT / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # no limit: "max" (v2) or a huge number (v1)
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (the in-memory check is then skipped)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _new_batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An empty tensor; with `shared`, in shared memory inside a DataLoader worker (what default_collate does)."""
    if not shared or torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    empty = torch.empty(0, dtype=dtype)
    return empty.new(empty._typed_storage()._new_shared(int(np.prod(shape)))).view(shape)


def draw_latents_from_moments(moments: torch.Tensor, generator: torch.Generator | None = None,
                              return_flip: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DiT's on-the-fly augmentation from stored moments (N, 2, 2, C, h, w): per sample a random flip, then a
    fresh posterior draw mean + std * eps. Returns float32 (N, C, h, w), with `return_flip` also the flips (N,)
    (1 = flipped, for REPA's clean images). All randomness comes from `generator` (drawn on its device, then
    moved), so the trainer's RNG state alone decides it and resumes repeat it exactly."""
    if moments.ndim != 6 or tuple(moments.shape[1:3]) != (2, 2):
        raise ValueError(f"moments must be (N, 2, 2, C, h, w) [flip][mean, std], got {tuple(moments.shape)}")
    n = moments.shape[0]
    rng_device = generator.device if generator is not None else moments.device
    flip = torch.randint(0, 2, (n,), generator=generator, device=rng_device).to(moments.device)
    eps = torch.randn(moments.shape[:1] + moments.shape[3:], generator=generator, device=rng_device,
                      dtype=torch.float32).to(moments.device)
    chosen = moments[torch.arange(n, device=moments.device), flip]
    z = chosen[:, 0].float() + chosen[:, 1].float() * eps
    return (z, flip) if return_flip else z
