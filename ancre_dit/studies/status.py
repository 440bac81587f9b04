"""Where each run stands, read from disk (checkpoints, logs, the append-only `<run>/study_status.jsonl`),
so any machine can tell. States: done (a complete checkpoint at max_steps), running (unchecked on another
host), submitted, failed, stopped (before max_steps: a rerun resumes it), not started.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..training.run_evaluation import read_evals
from ..files import append_jsonl, read_jsonl
from ..training.checkpointing import list_checkpoints
from .spec import Job

EVENTS = "study_status.jsonl"
LOG = "study.log"
STATES = ("done", "running", "submitted", "stopped", "failed", "not started")


def record_event(run_dir: Path, event: str, **fields: Any) -> None:
    """Appends a launch event to the run's status file (one write, safe beside other writers)."""
    append_jsonl(Path(run_dir) / EVENTS, {"event": event, "time": round(time.time(), 3),
                                          "host": socket.gethostname(), **fields})


@dataclass
class RunStatus:
    job: Job
    state: str
    step: int
    max_steps: int
    heldout_loss: float | None
    exit_code: int | None = None
    error: str | None = None


def finished_at(run_dir: Path, max_steps: int) -> int | None:
    """The newest complete checkpoint's step when it reached max_steps, else None."""
    saved = list_checkpoints(run_dir)
    return saved[-1][0] if saved and saved[-1][0] >= max_steps else None


def run_status(job: Job, max_steps: int) -> RunStatus:
    run_dir = job.run_dir
    evals = [e for e in read_evals(run_dir) if "heldout_loss" in e.get("metrics", {})]
    heldout = float(evals[-1]["metrics"]["heldout_loss"]) if evals else None
    done_at = finished_at(run_dir, max_steps)
    if done_at is not None:
        return RunStatus(job, "done", done_at, max_steps, heldout)
    # the last step logged or saved (metrics.jsonl is written more often than checkpoints)
    saved = list_checkpoints(run_dir)
    step = max([int(r.get("step", 0)) for r in read_jsonl(run_dir / "logs" / "metrics.jsonl")[-1:]]
               + [saved[-1][0] if saved else 0])
    events = read_jsonl(run_dir / EVENTS)
    last = events[-1] if events else {}
    if last.get("event") == "failed":
        return RunStatus(job, "failed", step, max_steps, heldout, last.get("exit_code"), last.get("error"))
    if last.get("event") == "started" and not (last.get("host") == socket.gethostname() and last.get("pid")
                                               and not _alive(int(last["pid"]))):
        state = "running"  # on another host, a started launch cannot be checked
    elif last.get("event") == "submitted":
        state = "submitted"
    else:
        state = "stopped" if events or step else "not started"
    return RunStatus(job, state, step, max_steps, heldout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def record_exit(run_dir: Path, code: int, finished: bool, **fields: Any) -> tuple[str, str | None]:
    """Records how a launch ended; returns (done / stopped (before max_steps) / failed, its log's error line)."""
    if code:
        fields.update(error=last_error_line(run_dir / LOG))
    elif not finished:
        fields.update(reason="stopped before max_steps by a signal; a requeue or a rerun resumes it")
    state = "failed" if code else "done" if finished else "stopped"
    record_event(run_dir, "finished" if state == "done" else state, exit_code=code, **fields)
    return state, fields.get("error")


def last_error_line(log: Path, limit: int = 1 << 16) -> str | None:
    """Why a run failed: its log's last `error:` line, else the last naming an Error or Exception, else the last."""
    if not log.is_file():
        return None
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - limit))
        text = f.read().decode("utf-8", "replace")
    lines = [part.strip() for line in text.splitlines() for part in line.split("\r")[-1:] if part.strip()]
    for test in (lambda s: s.startswith("error:"), lambda s: "Error" in s or "Exception" in s):
        if hits := [s for s in lines if test(s)]:
            return hits[-1][:300]
    return lines[-1][:300] if lines else None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (terminal output)."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def status_table(statuses: Sequence[RunStatus]) -> str:
    rows = [(s.job.name, s.job.arm, s.job.seed, s.state, f"{s.step}/{s.max_steps}",
             None if s.heldout_loss is None else f"{s.heldout_loss:.4g}") for s in statuses]
    text = format_table(("run", "arm", "seed", "state", "step", "held-out loss"), rows)
    if failed := [s for s in statuses if s.state == "failed"]:
        text += "\n\nfailed:\n" + "\n".join(f"  {s.job.name}: exit code {s.exit_code}: {s.error or '(no message)'} "
                                            f"(log: {s.job.run_dir / LOG})" for s in failed)
    counts = ", ".join(f"{n} {state}" for state in STATES if (n := sum(s.state == state for s in statuses)))
    return f"{text}\n\n{counts}"
