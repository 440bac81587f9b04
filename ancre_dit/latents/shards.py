"""The shard files: written atomically with a checksum, read back for resume, and checked by `--verify`.

Each shard `shard-XXXXX.safetensors` comes with `shard-XXXXX.safetensors.sha256` (for `sha256sum -c`): a
rerun skips a shard only if both exist and agree. Its safetensors metadata is one key, `ancre_dit`, a JSON
string (shard number, image count, extraction fingerprint, per-file report): safetensors writes a map in
arbitrary order, which would make identical runs' bytes (and checksums) differ.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

from ancre_dit.data.latent_shards import IMAGE_KEY, SHARD_KEYS, read_manifest, shard_file_name
from ancre_dit.files import sha256_file, write_atomic

META_KEY = "ancre_dit"


def checksum_path(shard_path: Path) -> Path:
    return shard_path.with_name(shard_path.name + ".sha256")


def write_shard(out: Path, shard: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """Writes the shard then its checksum file (in that order); returns the sha256."""
    path = out / shard_file_name(shard)
    remove_stale_tmp(out, path.name)  # leftovers of a killed writer of this shard (and of its checksum file)
    data = save({k: v.contiguous() for k, v in tensors.items()},
                metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(path, data)
    write_atomic(checksum_path(path), f"{digest}  {path.name}\n".encode())
    return digest


def remove_stale_tmp(out: Path, shard: str = "shard-") -> None:
    """Deletes the temporary files that killed writers left of the shards whose names start with `shard`
    (all of them by default: call that only once no process is writing)."""
    for stale in glob.glob(f"{glob.escape(str(out / shard))}*.tmp*"):
        os.remove(stale)


def read_checksum(shard_path: Path) -> str | None:
    try:
        text = checksum_path(shard_path).read_text().split()
    except OSError:
        return None
    return text[0] if text else None


def read_shard_meta(shard_path: Path) -> dict[str, Any] | None:
    """The shard's own metadata, or None when the file is missing or not a readable shard."""
    try:
        with safe_open(str(shard_path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001 - unreadable header: treat as "no shard here"
        return None


def shard_is_complete(shard_path: Path) -> bool:
    """True when the shard and its checksum file exist and the file's bytes match the checksum."""
    expected = read_checksum(shard_path)
    return expected is not None and shard_path.is_file() and sha256_file(shard_path) == expected


# -- --verify LATENT_DIR: a finished shard set against its manifest, one line per bad shard ---------

_DTYPES = {"mean": torch.float16, "std": torch.float16, "label": torch.int64, "index": torch.int64,
           IMAGE_KEY: torch.uint8}


def _check_tensors(path: Path, k: int, entry: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """Structure of one shard: keys, dtypes, shapes, labels in range, indices inside the shard's span."""
    count, shape = int(entry["count"]), tuple(manifest["latent_shape"])
    wanted = dict(zip(SHARD_KEYS, [(count, 2, *shape), (count, 2, *shape), (count,), (count,)]))  # mean std label index
    if manifest.get("images"):  # extracted with --keep-images
        size = int(manifest["image_size"])
        wanted[IMAGE_KEY] = (count, 3, size, size)
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if missing := [key for key in wanted if key not in keys]:
                return [f"lacks tensors {', '.join(missing)}"]
            t = {key: f.get_tensor(key) for key in wanted}
    except Exception as err:  # noqa: BLE001 - any parse failure means a corrupt shard
        return [f"unreadable ({str(err).splitlines()[0] if str(err) else type(err).__name__})"]
    problems = [f"{key} is {str(t[key].dtype).removeprefix('torch.')} {tuple(t[key].shape)}, "
                f"expected {str(_DTYPES[key]).removeprefix('torch.')} {want}"
                for key, want in wanted.items() if t[key].dtype != _DTYPES[key] or tuple(t[key].shape) != want]
    if problems:
        return problems
    labels, index = t["label"], t["index"]
    if count and not (0 <= int(labels.min()) and int(labels.max()) < int(manifest["num_classes"])):
        problems.append(f"labels outside [0, {manifest['num_classes']})")
    lo, hi = k * int(manifest["shard_size"]), (k + 1) * int(manifest["shard_size"])
    if count and (int(index.min()) < lo or int(index.max()) >= hi or bool((index[1:] <= index[:-1]).any())):
        problems.append(f"image indices not increasing inside [{lo}, {hi})")
    if not (torch.isfinite(t["mean"]).all() and torch.isfinite(t["std"]).all()):
        problems.append("non-finite values")
    elif count and bool((t["std"] < 0).any()):
        problems.append("negative std")
    return problems


def verify_latent_dir(root: str | os.PathLike, progress: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Returns (manifest, problems): one line per missing or corrupt shard, plus set-level mismatches.
    A missing or foreign manifest raises ValueError (one line) instead."""
    root = Path(root)
    manifest = read_manifest(root)
    shards = manifest.get("shards", [])
    problems = []
    if len(shards) != int(manifest["num_shards"]):
        problems.append(f"manifest lists {len(shards)} shards but num_shards={manifest['num_shards']}")
    for k, entry in enumerate(tqdm(shards, desc="verifying shards", unit="shard", disable=not progress)):
        name = entry["file"]
        if name != shard_file_name(k):
            problems.append(f"{name}: listed at position {k}, expected {shard_file_name(k)}")
            continue
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        reasons = ["checksum mismatch (file changed or corrupt)"] if sha256_file(path) != entry["sha256"] else []
        reasons += _check_tensors(path, k, entry, manifest)
        if reasons:
            problems.append(f"{name}: corrupt: {'; '.join(reasons)}")
    total = sum(int(s["count"]) for s in shards)
    if total != int(manifest["num_images"]):
        problems.append(f"shards hold {total} images but the manifest says num_images={manifest['num_images']}")
    return manifest, problems
