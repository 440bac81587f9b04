"""Small file helpers shared by the long jobs (extraction, sampling, evaluation)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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
