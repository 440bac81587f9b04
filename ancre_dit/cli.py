"""What every command shares: where it writes, one clear line for a user's mistake, a traceback for a bug,
and the processes of a launched job."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

from .errors import UserError

# -- where a command writes (one rule for every --out; docs/reliability.md, "Where outputs go") ------------------
def output_file(path: str | os.PathLike, suffixes: Sequence[str], flag: str = "--out") -> Path:
    """A file a command writes: ending in one of `suffixes`, not a folder, no parent a file; an existing one is
    replaced (a derived output a rerun regenerates)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name ending in {suffixes[0]}")
    if path.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {path}: this command writes a {' or '.join(suffixes)} file; give a name ending in "
                        f"{suffixes[0]}")
    _check_parents(path, flag)
    return path


def output_folder(path: str | os.PathLike, kind: str, marker: str | tuple[str, ...], flag: str = "--out",
                  replace_own: bool = True, overwrite: bool = False) -> Path:
    """A folder a command fills: new or empty, or of its own kind (a file matches a `marker` glob), updated when
    `replace_own`, else only with --overwrite; a non-empty folder of another kind is refused."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a folder for the {kind}")
    _check_parents(path, flag)
    if path.is_dir() and any(path.iterdir()):
        markers = (marker,) if isinstance(marker, str) else marker
        if not any(True for pattern in markers for _ in path.glob(pattern)):
            raise UserError(f"{flag} {path} is a non-empty folder that holds no {kind} ({' or '.join(markers)} "
                            f"missing); give a new or empty folder")
        if not (replace_own or overwrite):
            raise UserError(f"{flag} {path} already holds a {kind}; give another folder, or pass --overwrite to "
                            f"replace it")
    return path


def _check_parents(path: Path, flag: str) -> None:
    """No parent is a file and the nearest existing folder is writable: found before the work, not after."""
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder")
    nearest = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if nearest is not None and not os.access(nearest, os.W_OK):
        raise UserError(f"{flag} {path}: {nearest} is not writable (a read-only file system or folder); give a "
                        f"path in a writable folder")


class CommandParser(argparse.ArgumentParser):
    """argparse whose usage mistakes are UserErrors: one `error:` line pointing to --help, no usage block."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help")


def run_cli(main: Callable[[], int | None]) -> None:
    """Runs `main`: a `UserError` prints `error: <message>` once per job and exits 2 (ANCRE_DEBUG=1: its traceback);
    any other exception is a bug: its traceback, a line saying so, exit 1. Ctrl-C exits 130 after `main` saved."""
    try:
        code = main()
    except UserError as err:
        if os.environ.get("ANCRE_DEBUG"):
            raise
        _exit(2, f"error: {err}" if os.environ.get("RANK", "0") == "0" else None)  # every rank fails alike: one line
    except KeyboardInterrupt:
        _exit(130, "interrupted")
    except Exception:  # noqa: BLE001 - a bug: show where it happened
        _exit(1, f"{traceback.format_exc()}internal error: this is a bug in ancre-dit, not a problem with your input; "
              "please report it to the ancre-dit issue tracker with the traceback above and the command you ran")
    sys.exit(code or 0)


def _exit(code: int, message: str | None) -> NoReturn:
    """Closes the progress bars an error left open (so the message starts a line of its own and no redraw
    follows it), prints the message and exits."""
    if "tqdm" in sys.modules:  # no bar was ever drawn otherwise
        for bar in list(getattr(sys.modules["tqdm"].tqdm, "_instances", ())):
            bar.close()
    if message is not None:
        print(message, file=sys.stderr)
    sys.exit(code)


class SingleProcess:
    """The slice of accelerate's PartialState a one-process job uses, leaving no accelerate singleton behind."""

    process_index, num_processes, is_main_process = 0, 1, True

    def __init__(self, cpu: bool = False):
        import torch
        self.device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")

    def wait_for_everyone(self) -> None:
        pass


# Seconds a process waits in a collective before the job fails (train.collective_timeout_s, --collective-timeout-s):
# NCCL's 10 minutes are less than the main process may work alone (a slow checkpoint, the reference features).
COLLECTIVE_TIMEOUT_S = 1800.0


@contextlib.contextmanager
def job_processes(cpu: bool = False, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Iterator:
    """This process alone, or under torchrun (WORLD_SIZE > 1) accelerate's PartialState, its process group
    destroyed on the way out (gloo aborts at exit otherwise). Without a GPU, with ACCELERATE_USE_CPU=1 or `cpu`,
    the group runs on gloo (PartialState alone would treat each process as a lone one)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield SingleProcess(cpu)
        return
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available(),
                         timeout=timedelta(seconds=timeout_s))
    try:
        yield state
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
