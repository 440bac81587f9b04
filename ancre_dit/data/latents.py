"""Training-side reader of the VAE latent shards written by scripts/extract_latents.py.

Layout of LATENT_DIR: `manifest.json` plus `shard-XXXXX.safetensors`, each shard holding
`mean`, `std` float16 (n, 2, C, h, w) (index 1 along dim 1 = horizontally flipped image; both already
multiplied by the VAE scaling factor), `label` int64 (n,) and `index` int64 (n,) (position of the
image in the sorted file list). Training draws a fresh posterior sample per step (`draw_latents_from_moments`).
"""
from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset
from ..errors import UserError
from ..weights import file_problem

FORMAT_NAME = "ancre-dit-latents"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REPORT_NAME = "extraction_report.tsv"
SHARD_KEYS = ("mean", "std", "label", "index")


def shard_file_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Loads LATENT_DIR/manifest.json; anything missing or foreign is one clear ValueError."""
    root = Path(root)
    path = root / MANIFEST_NAME
    hint = ("run scripts/extract_latents.py --data-path IMAGES --vae VAE_DIR --out "
            f"{root} (rerun the same command to finish an interrupted extraction), then check it with "
            f"scripts/extract_latents.py --verify {root}")
    if not root.is_dir():
        raise UserError(f"latent directory {root} does not exist; {hint}")
    if not path.is_file():
        raise UserError(f"{root} has no {MANIFEST_NAME} (not a latent directory, or its extraction did not finish); {hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not a {FORMAT_NAME} manifest; {hint}")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(f"{path} has format version {manifest.get('version')}, this code reads "
                         f"version {FORMAT_VERSION}; re-extract the latents with this version")
    return manifest


class LatentShardDataset(Dataset):
    """Random access over all images of a latent directory.

    `ds[i] -> (moments, label)`: moments float16 (2, 2, C, h, w) indexed [flip][0=mean, 1=std].
    Shards are memory-mapped through safetensors and opened lazily (so each DataLoader worker
    opens its own handles); at most `max_open_shards` stay open per process.
    """

    def __init__(self, root: str | os.PathLike, max_open_shards: int = 64):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.num_classes: int = int(self.manifest["num_classes"])
        self.latent_shape: tuple[int, int, int] = tuple(int(s) for s in self.manifest["latent_shape"])
        shards = self.manifest["shards"]
        missing = [s["file"] for s in shards if not (self.root / s["file"]).is_file()]
        if missing:
            raise UserError(f"{self.root} lacks {len(missing)} shard(s) listed in its manifest "
                             f"(first: {missing[0]}); run scripts/extract_latents.py --verify {self.root}, "
                             "then rerun the extraction to rewrite them")
        for s in shards:  # headers only (cheap): a damaged shard is one line here, not a traceback in a worker
            problem = file_problem(self.root / s["file"])
            if problem:
                raise UserError(f"latent shard {problem}; run scripts/extract_latents.py --verify {self.root}, "
                                "then rerun the extraction to rewrite it")
        nonempty = [s for s in shards if int(s["count"]) > 0]
        self._files = [self.root / s["file"] for s in nonempty]
        self._starts: list[int] = []
        total = 0
        for s in nonempty:
            self._starts.append(total)
            total += int(s["count"])
        self._len = total
        if total != int(self.manifest["num_images"]):
            raise UserError(f"{self.root}/{MANIFEST_NAME} lists {total} images in its shards but "
                             f"num_images={self.manifest['num_images']}; run --verify and re-extract")
        self._max_open = max(1, max_open_shards)
        self._open: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return self._len

    def _handle(self, shard: int):
        """(open safetensors handle, labels of the shard), least recently used evicted first."""
        entry = self._open.get(shard)
        if entry is None:
            handle = safe_open(str(self._files[shard]), framework="pt")
            entry = (handle, handle.get_tensor("label").tolist())
            self._open[shard] = entry
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)  # the file closes when its handle is dropped
        else:
            self._open.move_to_end(shard)
        return entry

    def locate(self, i: int) -> tuple[int, int]:
        """Global image position -> (shard position among non-empty shards, row in the shard)."""
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} latents")
        i %= self._len
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        shard, row = self.locate(int(i))
        f, labels = self._handle(shard)
        mean = f.get_slice("mean")[row:row + 1][0]
        std = f.get_slice("std")[row:row + 1][0]
        return torch.stack([mean, std], dim=1), labels[row]

    def __getstate__(self) -> dict[str, Any]:
        # Open handles are not picklable (spawned DataLoader workers); each worker reopens lazily.
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state


def draw_latents_from_moments(moments: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """DiT's on-the-fly augmentation from stored moments (N, 2, 2, C, h, w): per sample a random flip,
    then a fresh posterior draw mean + std * eps. Returns float32 (N, C, h, w).

    All randomness comes from `generator` (drawn on the generator's device, then moved), so the
    trainer's RNG state alone decides the result and resumed runs repeat it exactly.
    """
    if moments.ndim != 6 or tuple(moments.shape[1:3]) != (2, 2):
        raise ValueError(f"moments must be (N, 2, 2, C, h, w) [flip][mean, std], got {tuple(moments.shape)}")
    n = moments.shape[0]
    rng_device = generator.device if generator is not None else moments.device
    flip = torch.randint(0, 2, (n,), generator=generator, device=rng_device).to(moments.device)
    eps = torch.randn(moments.shape[:1] + moments.shape[3:], generator=generator, device=rng_device,
                      dtype=torch.float32).to(moments.device)
    chosen = moments[torch.arange(n, device=moments.device), flip]
    return chosen[:, 0].float() + chosen[:, 1].float() * eps
