"""Writing shards atomically with a checksum, and reading back what resume and --verify need.

Each shard `shard-XXXXX.safetensors` comes with `shard-XXXXX.safetensors.sha256` (sha256sum format, so
`sha256sum -c LATENT_DIR/*.sha256` works): a rerun skips a shard only if both exist and agree. Its
safetensors metadata holds one key, `ancre_dit`, a JSON string (shard number, image count, extraction
fingerprint, per-file report): one key because safetensors writes a map in arbitrary order, which
would make the bytes (and the checksum) differ between identical runs.
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

from ancre_dit.data.latent_shards import shard_file_name
from ancre_dit.files import sha256_file, write_atomic

META_KEY = "ancre_dit"


def checksum_path(shard_path: Path) -> Path:
    return shard_path.with_name(shard_path.name + ".sha256")


def write_shard(out: Path, shard: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """Writes the shard then its checksum file (in that order); returns the sha256."""
    path = out / shard_file_name(shard)
    for stale in glob.glob(str(path) + ".tmp*") + glob.glob(str(checksum_path(path)) + ".tmp*"):
        os.remove(stale)  # leftovers of a killed writer of this shard
    data = save({k: v.contiguous() for k, v in tensors.items()},
                metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(path, data)
    write_atomic(checksum_path(path), f"{digest}  {path.name}\n".encode())
    return digest


def remove_stale_tmp(out: Path) -> None:
    """Deletes temporary files that killed writers left (call only once no process is writing)."""
    for stale in glob.glob(str(out / "shard-*.tmp*")):
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
