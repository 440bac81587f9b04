"""Small file helpers shared by every layer: hashing, atomic writes, JSONL, YAML, structural checks."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickletools
import re
import zipfile
from pathlib import Path

import yaml
from safetensors import SafetensorError, safe_open

from .errors import UserError

_log = logging.getLogger("ancre_dit")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (shards and weight files can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """A temporary name per process, fsync, then rename: a kill at any moment leaves the old state or
    the complete file, never half a file that a rerun would trust."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DuplicateKeyError(ValueError):
    """A YAML mapping gives one key twice (`line N: 'key' is given twice ...`)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently, dropping a whole section or arm."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise DuplicateKeyError(f"line {key_node.start_mark.line + 1}: {key!r} is given twice; give each "
                                        f"key once")
            seen.add(key)
        return super().construct_mapping(node, deep)


# PyYAML (YAML 1.1) reads 1e-4, a number without a dot, as a string; YAML 1.2 and users read a number.
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                       list("-+0123456789."))


def load_yaml_unique(text: str):
    """yaml.safe_load that refuses a key given twice in one mapping (DuplicateKeyError) and reads 1e-4
    as a number, for what users write by hand."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_yaml_mapping(path: Path, kind: str, fix_missing: str, contents: str) -> dict:
    """A hand-written YAML file (a config, a study) as a mapping; a missing, empty or non-YAML file, a key
    given twice or anything but a mapping is one UserError naming it (`contents`: what it must hold)."""
    if not path.is_file():
        raise UserError(f"{kind} file {path} not found; {fix_missing}")
    try:
        raw = load_yaml_unique(path.read_text())
    except DuplicateKeyError as err:
        raise UserError(f"{path}: {err} (PyYAML would keep only the last)") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file; pass a YAML {kind} file") from None
    if raw is None:
        raise UserError(f"{kind} file {path} is empty; give it {contents}")
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a mapping with {contents}")
    return raw


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a .jsonl file in file order ([] when missing). A line that does not parse (a
    writer killed mid-record) is skipped and reported in one warning naming the file and the lines."""
    path = Path(path)
    if not path.is_file():
        return []
    rows, bad = [], []
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    if bad:
        _log.warning("%s: skipped %d line(s) that are not complete JSON records (line %s)", path, len(bad),
                     ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""))
    return rows


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Appends `record` as one line, in one write, to an append-only log. A torn last line (a writer killed
    mid-record) is cut off first, with a warning, so the record is not glued to the fragment and lost with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record) + "\n").encode()  # a record that does not serialise leaves the file alone
    with open(path, "a+b", buffering=0) as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(end - 1, 0))
        if end and f.read(1) != b"\n":  # a torn last line: cut after the last newline
            start = max(0, end - (1 << 20))
            f.seek(start)
            tail = f.read()
            cut = start + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
            f.seek(0)
            line = f.read(cut).count(b"\n") + 1
            f.truncate(cut)
            _log.warning("%s: line %d was torn (a writer stopped mid-record) and is dropped; the records before "
                         "it are kept", path, line)
        f.write(data)  # O_APPEND, unbuffered: one write call per record


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read, judged from its structure without loading it (None = readable): a short
    safetensors file, a broken zip directory or checksum, a pickle without its end, invalid JSON."""
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
