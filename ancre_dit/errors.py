"""The one exception type that means "the user can fix this": commands print it as one line.

Every input check in the package raises `UserError` (or `MissingFileError`); the command-line
faces catch only these (`ancre_dit.cli.run_cli`), so anything else is a bug and keeps its
traceback. `UserError` subclasses `ValueError` (and `MissingFileError` also `FileNotFoundError`)
so library callers that catch the built-in types keep working.
"""
from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix (bad flag, missing file, wrong checkpoint); printed as one line."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or lacks what it should hold)."""


__all__ = ["UserError", "MissingFileError"]
