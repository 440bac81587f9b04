"""Decisions every process must share, made once by the main process: on a shared filesystem with
stale caches, processes that each read for themselves can go separate ways (one resumes, another
starts over). `state`: anything with `num_processes` and `is_main_process` (an Accelerator, ...).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import UserError
from . import checkpointing as ckpt

T = TypeVar("T")


def main_decides(state: Any, decide: Callable[[], T]) -> T:
    """decide() on the main process; every process returns its result (or raises its UserError)."""
    if state.num_processes <= 1:
        return decide()
    from accelerate.utils import broadcast_object_list

    answer: list[Any] = [None]
    if state.is_main_process:
        try:
            answer[0] = ("ok", decide())
        except UserError as err:
            answer[0] = ("user", str(err))
        except BaseException as err:  # a bug: the others stop too, the main process keeps its traceback
            broadcast_object_list([("bug", f"{type(err).__name__}: {err}")])
            raise
    broadcast_object_list(answer)
    kind, value = answer[0]
    if kind == "user":
        raise UserError(value)
    if kind == "bug":
        raise RuntimeError(f"the main process failed while deciding for all processes ({value}); see its traceback")
    return value


def agree_on_resume(state: Any, resume: str | None, run_dir: str | Path,
                    warn: Callable[[str], None] = print) -> Path | None:
    """checkpointing.resolve_resume on the main process (its warnings printed there), shared by all."""
    return main_decides(state, lambda: ckpt.resolve_resume(resume, run_dir, warn=warn))
