"""The one exception type that means "the user can fix this", printed as one line: every input check raises
`UserError` (or `MissingFileError`), and `ancre_dit.cli.run_cli` catches only these, so anything else is a bug
and keeps its traceback. They subclass ValueError (and FileNotFoundError) for callers of the built-in types."""
from __future__ import annotations

import re


class UserError(ValueError):
    """A problem the user can fix (bad flag, missing file, wrong checkpoint); printed as one line."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or lacks what it should hold)."""


def or_list(names) -> str:
    """"a", "a or b", "a, b or c"."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def invalid_value(err, prefix: str = "") -> UserError:
    """A pydantic ValidationError's first problem in one line: the key (`prefix` + its location), pydantic's
    words for what is wrong, the value given."""
    first = err.errors()[0]
    key = prefix + ".".join(str(part) for part in first["loc"] if not isinstance(part, int))
    problem = re.split(r", got |, unable | after validation", first["msg"])[0]
    problem = problem.replace("Input should", "must").replace("Value should", "must").replace("Value error, ", "")
    given = first.get("input")
    return UserError(f"{key} {problem}, got {'null' if given is None else repr(given)}")
