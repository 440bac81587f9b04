"""An exclusive claim on a run folder: one training writes to it at a time (two would replace each
other's checkpoints and mix their logs).

The main process holds an OS file lock (flock) on RUN/.lock, which the kernel drops however the process
ends (kill -9 included); the file's pid and host only name the holder in the refusal. A process keeps
its claims until it exits or calls `release_run_dir`, so trainings in one process may reuse a folder.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
from pathlib import Path
from typing import IO

from ..errors import UserError
from .checkpointing import checkpoints_dir, TMP_PREFIX
from .rank_decisions import main_decides

LOCK_FILE = ".lock"

_held: dict[Path, tuple[IO[str], bool]] = {}  # resolved run folder -> (its open lock file, created by this process)


def acquire_run_dir(run_dir: str | Path) -> None:
    """Claims `run_dir` for this process (creating it), or raises a UserError naming its holder; then
    removes the temporaries of saves that died midway."""
    run_dir = Path(run_dir)
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise UserError(f"run_dir {run_dir}: {parent} is a file, not a folder; set run_dir to a folder")
    try:
        run_dir.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    except OSError as err:
        raise UserError(f"run_dir {run_dir} cannot be created ({err.strerror}); set run_dir to a writable "
                        f"folder") from None
    key = run_dir.resolve()
    if key in _held:  # claimed by an earlier training of this process
        _held[key] = (_held[key][0], False)
        return
    lock_path = run_dir / LOCK_FILE
    try:
        f = open(lock_path, "a+")
    except OSError as err:
        raise UserError(f"run_dir {run_dir} is not writable ({err.strerror}: {lock_path}); set run_dir to a "
                        f"writable folder") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        f.close()
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise UserError(f"run_dir {run_dir}: the lock file {lock_path} cannot be locked ({err.strerror}); "
                            f"put run_dir on a local file system") from None
        try:
            holder = lock_path.read_text().strip()
        except OSError:
            holder = ""
        raise UserError(f"run_dir {run_dir} is in use by another training ({holder or 'another process'}); wait "
                        f"for it to finish or stop it, or set another run_dir") from None
    try:
        f.truncate(0)  # (in append mode the write goes to the new end)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    except OSError as err:
        f.close()
        raise UserError(f"run_dir {run_dir} is not writable ({err.strerror}); free space or set run_dir to a "
                        f"writable folder") from None
    _held[key] = (f, created)
    # Claimed, no save is in progress: checkpoints/.tmp-* and write_atomic's `<file>.tmp<pid>` are leftovers.
    for folder in checkpoints_dir(run_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(folder, ignore_errors=True)
    for path in run_dir.glob("*.tmp*"):
        if path.is_file() and re.search(r"\.tmp\d+$", path.name):
            path.unlink(missing_ok=True)


def release_run_dir(run_dir: str | Path) -> None:
    """Gives up this process's claim on `run_dir` (no-op when it holds none)."""
    f, _ = _held.pop(Path(run_dir).resolve(), (None, False))
    if f is not None:
        f.close()  # closing the last descriptor drops the flock


def abandon_new_run_dir(run_dir: str | Path) -> None:
    """After a start that failed: releases the claim and removes the folder when this process created
    it and it holds no checkpoint (a refused start leaves nothing behind)."""
    key = Path(run_dir).resolve()
    created = key in _held and _held[key][1]
    release_run_dir(run_dir)
    if created and not any(True for _ in checkpoints_dir(key).glob("[0-9]*")):
        shutil.rmtree(key, ignore_errors=True)


def claim_run_dir(run_dir: str | Path, accelerator) -> None:
    """Collective: the main process claims the folder; every process raises its UserError, if any."""
    main_decides(accelerator, lambda: acquire_run_dir(run_dir))
