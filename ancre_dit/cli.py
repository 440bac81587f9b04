"""Shared behaviour of the command-line faces: one clear line for a user's mistake, a traceback for a bug."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

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
