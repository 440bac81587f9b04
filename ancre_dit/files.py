"""Small file helpers shared by every layer: hashing, atomic writes, JSONL, structural checks."""
from __future__ import annotations

import hashlib
import json
import os
import pickletools
import zipfile
from pathlib import Path

from safetensors import SafetensorError, safe_open

_CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (shards and weight files can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """A unique temporary name per process, fsync, then rename: a kill at any moment leaves either
    the old state or the complete file, never half a file that a rerun would trust."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a .jsonl file in file order; a torn line (a process killed mid-write)
    is skipped; a missing file is an empty list."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read, judged from its structure without loading it (None = readable):
    a safetensors header that does not cover the file, a torch/zip archive whose directory or
    checksums are broken, a pickle without its end, invalid JSON. Truncation, the usual damage of a killed copy, fails all three."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                pass
        elif path.suffix in (".bin", ".pt", ".pth", ".pkl") and zipfile.is_zipfile(path):  # torch.save's format
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
            if bad is not None:
                return f"{path}: member {bad} fails its CRC check"
        elif path.suffix == ".pkl":  # a plain pickle: walk its opcodes without executing any; a cut one has no STOP
            with open(path, "rb") as f:
                for _ in pickletools.genops(f):
                    pass
        elif path.suffix in (".bin", ".pt", ".pth"):
            return f"{path}: not a torch archive (no zip directory; truncated?)"
        elif path.suffix == ".json":
            json.loads(path.read_text())
    except (SafetensorError, OSError, UnicodeDecodeError, ValueError, zipfile.BadZipFile) as err:
        return f"{path}: {' '.join(str(err).split())}"
    return None
