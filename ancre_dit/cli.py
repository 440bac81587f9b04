"""Shared behaviour of the command-line faces and the jobs they launch: one clear line for a user's
mistake, a traceback for a bug; the processes of a launched job."""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Callable, Iterator

from .errors import UserError

BUG_REPORT = ("this is a bug in ancre-dit, not a problem with your input; please report it to the ancre-dit "
              "issue tracker with the traceback above and the command you ran")


def run_cli(main: Callable[[], int | None]) -> None:
    """Runs `main`. A `UserError` prints `error: <message>` and exits 2 (ANCRE_DEBUG=1 shows its
    traceback); any other exception is a bug: its traceback, then one line saying so, exit 1.
    Ctrl-C exits 130 after `main` has had its chance to save."""
    try:
        code = main()
    except UserError as err:
        if os.environ.get("ANCRE_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception:  # noqa: BLE001 - a bug: show where it happened
        traceback.print_exc()
        print(f"internal error: {BUG_REPORT}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)


class SingleProcess:
    """The slice of accelerate's PartialState a one-process job uses (device, rank, world, barrier),
    so in-process callers (tests, notebooks) leave no accelerate singleton behind."""

    process_index, num_processes, is_main_process = 0, 1, True

    def __init__(self, cpu: bool = False):
        import torch
        self.device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")

    def wait_for_everyone(self) -> None:
        pass


@contextlib.contextmanager
def job_processes(cpu: bool = False) -> Iterator:
    """The processes of a job: this one alone, or, under torchrun / accelerate launch (WORLD_SIZE > 1),
    accelerate's PartialState, whose process group is destroyed on the way out (a group left open
    makes gloo abort the process at exit). Without a GPU, or with ACCELERATE_USE_CPU=1 or `cpu`,
    the group runs on the CPU (gloo): PartialState alone would treat each process as a lone one."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield SingleProcess(cpu)
        return
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    try:
        yield state
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
