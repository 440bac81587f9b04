"""Fetching assets into OUT/<name>/<file>, each verified before it counts. Plain URLs resume a cut download
(<file>.part) with a `Range` request; hub files resume on their own. A file is checked against its published
checksum, else the hub's SHA-256, else the one OUT/assets.json recorded at its first fetch; a failing one is removed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..errors import UserError
from ..files import sha256_file, write_atomic
from .catalog import ASSETS, Asset

RECORD_FILE = "assets.json"


def git_blob_sha1(path: Path) -> str:
    """The hub's ETag of a file kept in git (not LFS): git's blob hash of its bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def format_listing(assets: Mapping[str, Asset] = ASSETS) -> str:
    """Every asset with its source, files and checksum."""
    lines = []
    for a in assets.values():
        lines.append(f"{a.name}: {a.what}\n  source: {a.source}")
        for name in a.file_names:
            checksum = (f"sha256 {a.sha256[name]}" if name in a.sha256
                        else f"sha256 starting {a.hash_prefix} (published in the file name)" if a.hash_prefix
                        else "the hash the hub reports (LFS SHA-256, or git's blob hash)" if a.repo
                        else "no published checksum: its sha256 is recorded at download and checked after")
            lines.append(f"  {name}: size as the server reports it; {checksum}")
    return "\n".join(lines)


def fetch_all(out: str | Path, only: Iterable[str] | None = None, assets: Mapping[str, Asset] = ASSETS,
              endpoint: str | None = None, log: Callable[[str], None] = print) -> dict[str, list[Path]]:
    """Fetches the named assets (all by default) into OUT and prints the settings that use them."""
    names = list(only) if only else list(assets)
    if unknown := [n for n in names if n not in assets]:
        raise UserError(f"unknown asset {', '.join(unknown)}; choose from {', '.join(assets)} (--list shows them)")
    out = Path(out)
    fetched = {name: fetch(assets[name], out, endpoint=endpoint, log=log) for name in names}
    log("point the configs and commands at them:")
    for name, paths in fetched.items():
        path = paths[0] if len(paths) == 1 else paths[0].parent  # a VAE is its folder
        log("  " + "   ".join(s.format(path=path) for s in assets[name].settings))
    return fetched


def fetch(asset: Asset, out: Path, endpoint: str | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """OUT/<name>/<file> for each of the asset's files, downloaded unless there, and verified."""
    folder = out / asset.name
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in asset.file_names:
        path = folder / name
        reported = None if asset.url else _hub_download(asset, name, folder, endpoint, log)
        if asset.url and not path.is_file():
            _download_url(asset.url, path, log)
        _verify(asset, path, asset.sha256.get(name) or reported, out)  # a published checksum first
        log(f"{asset.name}: {path} verified")
        paths.append(path)
    return paths


def _download_url(url: str, path: Path, log: Callable[[str], None]) -> None:
    """Into path.part (resumed from its size), renamed when complete."""
    import requests
    from tqdm.auto import tqdm

    part = path.with_name(path.name + ".part")
    done = part.stat().st_size if part.is_file() else 0
    try:
        with requests.get(url, headers={"Range": f"bytes={done}-"} if done else {}, stream=True, timeout=60) as reply:
            if reply.status_code == 404:
                raise UserError(f"{url} was not found (HTTP 404); the asset moved: download it by hand into {path}")
            reply.raise_for_status()
            if done and reply.status_code != 206:  # the server ignored the range: start over
                done = 0
            total = int(reply.headers.get("Content-Length", 0)) + done
            log(f"downloading {url} -> {path}" + (f" (resuming at {done} bytes)" if done else ""))
            with open(part, "ab" if done else "wb") as f, tqdm(total=total or None, initial=done, unit="B",
                                                               unit_scale=True, desc=path.name) as bar:
                for block in reply.iter_content(1 << 16):  # small: a cut loses at most one block
                    f.write(block)
                    bar.update(len(block))
    except requests.RequestException as err:
        raise UserError(f"downloading {url} failed ({' '.join(str(err).split())}); rerun the same command to resume "
                        f"({part} keeps what arrived)") from None
    if total and part.stat().st_size != total:
        raise UserError(f"downloading {url} stopped at {part.stat().st_size} of {total} bytes; rerun the same "
                        f"command to resume")
    os.replace(part, path)


def _hub_download(asset: Asset, name: str, folder: Path, endpoint: str | None, log: Callable[[str], None]) -> str:
    """Downloads one hub file into the folder; returns the SHA-256 the hub reports."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        meta = get_hf_file_metadata(hf_hub_url(asset.repo, name, revision=asset.revision, endpoint=endpoint))
        if not (folder / name).is_file():
            log(f"downloading {asset.repo}/{name} -> {folder / name}")
        hf_hub_download(asset.repo, name, revision=asset.revision, local_dir=folder, endpoint=endpoint)
    except (HfHubHTTPError, OSError) as err:  # the hub client's network errors are OSErrors too
        if getattr(getattr(err, "response", None), "status_code", None) == 404:
            raise UserError(f"{asset.repo}/{name} ({asset.revision}) was not found on the hub; the asset moved: "
                            f"download it by hand into {folder}") from None
        raise UserError(f"downloading {asset.repo}/{name} failed ({' '.join(str(err).split())}); rerun the same "
                        "command to resume") from None
    return (meta.etag or "").strip('"')


def _verify(asset: Asset, path: Path, expected: str | None, out: Path) -> None:
    """Checks the file's SHA-256; without an expected value, against (or into) OUT/assets.json."""
    actual = sha256_file(path)
    record_path = out / RECORD_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    key = f"{asset.name}/{path.name}"
    if expected is None and asset.hash_prefix:
        ok, wanted = actual.startswith(asset.hash_prefix), f"{asset.hash_prefix}..."
    elif expected and len(expected) == 40:  # a small hub file kept in git: its ETag is git's blob hash
        ok, wanted = git_blob_sha1(path) == expected, f"git blob {expected}"
    else:
        wanted = expected if expected and len(expected) == 64 else record.get(key)
        ok = wanted is None or actual == wanted
    if not ok:
        path.unlink()
        raise UserError(f"{path} has SHA-256 {actual}, expected {wanted}: the download is damaged or not the published "
                        f"file; it was removed, rerun to fetch it again")
    if record.get(key) != actual:
        record[key] = actual
        write_atomic(record_path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
