"""The one range-check language: what a value accepts beyond its type (a numeric range, a set of
names, or a check defined where the value is used), declared beside the value (a config field in
training/config_schema.py, a topology option in models/topologies/registry.py) and checked by
`check_value`, so that every range error reads the same way.

A shared low layer: the model registry and the training config both declare their ranges here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import UserError


def or_list(names: Iterable[Any]) -> str:
    """"a", "a or b", "a, b or c"."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class Rule:
    """What a value accepts beyond its type. None (an unset optional value) is never checked."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    hint: str = ""  # what special values mean (e.g. "0 = off"), shown with a range error
    # Names the value must be one of: a tuple, or a registry dict (read when checked, so that
    # entries registered after the rule was declared count).
    choices: Iterable[str] | None = None
    noun: str | None = None  # "unknown <noun> 'x' in <key>; choose ..." rather than "<key> must be one of ..."
    check: Callable[[str, Any], None] | None = None  # a rule defined elsewhere: check(key, value)

    def options(self) -> tuple[str, ...]:
        return tuple(self.choices or ())

    def __call__(self, key: str, value: Any) -> None:
        if self.choices is not None and value not in self.options():
            raise UserError(f"unknown {self.noun} {value!r} in {key}; choose {or_list(self.options())}" if self.noun
                            else f"{key} must be one of {or_list(self.options())}, got {value!r}")
        if self.check is not None:
            self.check(key, value)
        inside = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if not inside:
            raise UserError(f"{key} must be {self._words()}{f' ({self.hint})' if self.hint else ''}, got {value}")

    def _words(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        if self.gt == 0:
            return "positive"
        if self.gt is not None:
            return f"> {self.gt:g}"
        return ">= 0" if self.ge == 0 else f"at least {self.ge:g}"


def check_value(key: str, value: Any, rule: Rule | None = None) -> None:
    """A UserError naming `key` when `value` is not finite (a float) or breaks `rule`: a value out of
    range would train NaN or fail deep inside torch with a traceback. A list's rule applies to each
    item; None is never checked."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            raise UserError(f"{key} must be a finite number, got {item}")
        if rule is not None and item is not None:
            rule(key, item)
