"""Shared behaviour of the command-line faces: one clear line for a user's mistake, not a traceback."""
from __future__ import annotations

import os
import sys
from typing import Callable


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file, wrong checkpoint); printed as one line."""


# Errors that, raised from our own input checks, describe a user mistake in their message.
USER_ERRORS = (UserError, ValueError, FileNotFoundError, KeyError)


def run_cli(main: Callable[[], int | None]) -> None:
    """Runs `main`; a user error prints `error: <message>` and exits 2 (set ANCRE_DEBUG=1 for
    the traceback). Ctrl-C exits 130 after `main` has had its chance to save."""
    try:
        code = main()
    except USER_ERRORS as err:
        if os.environ.get("ANCRE_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
