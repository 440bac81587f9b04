"""The GPU check's plan and its clock: the items in order, what each is expected to take, and the
limits that keep a short GPU slot from ending with nothing.

Each item's estimate is the seconds it took on the last GPU run (benchmarks/gpu_check_estimates.json,
data: rewrite it from a run's gpu_check.json with `--save-estimates`); an item with no measured
time carries a guess, marked as such. An item starts only when its estimate fits in the budget
left, and is cut once it runs past twice its estimate: a Python item by an alarm that raises in it,
a child process by killing its whole process group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ESTIMATES = Path(__file__).with_name("gpu_check_estimates.json")
NO_ESTIMATE_S = 60.0  # an item the estimates file does not name
CUT_FACTOR = 2.0


class ItemCut(Exception):
    """An item ran past its time limit."""


@dataclass
class Item:
    """One measurement: `measure(deadline)` returns its result, `store(result)` puts it (or the
    {"skipped" | "failed" | "cut": why} that stands for it) in the report."""
    name: str
    measure: Callable[["Deadline"], Any]
    store: Callable[[Any], None]
    headline: bool = False


@dataclass
class Estimate:
    seconds: float
    source: str  # "measured", "guess" or "none"


def load_estimates(path: Path = ESTIMATES) -> dict[str, Estimate]:
    data = json.loads(path.read_text())
    found = {name: Estimate(float(s), "measured") for name, s in data.get("measured_s", {}).items()}
    found.update({name: Estimate(float(s), "guess") for name, s in data.get("guessed_s", {}).items()})
    return found


def estimate_of(name: str, estimates: dict[str, Estimate]) -> Estimate:
    return estimates.get(name, Estimate(NO_ESTIMATE_S, "none"))


def save_estimates(items: list[dict], device: str, torch_version: str, path: Path = ESTIMATES) -> None:
    """Keeps the seconds of every item of a run that finished (ok) as measured; the others keep
    what the file had."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    measured, guessed = dict(old.get("measured_s", {})), dict(old.get("guessed_s", {}))
    for it in items:
        if it["status"] == "ok":
            measured[it["name"]] = round(it["seconds"], 1)
            guessed.pop(it["name"], None)
    payload = {"measured_on": f"{device}, torch {torch_version}", "measured_s": measured, "guessed_s": guessed}
    path.write_text(json.dumps(payload, indent=1) + "\n")


def plan_rows(items: list[Item], estimates: dict[str, Estimate], budget_s: float) -> list[dict]:
    """The run as it would go if every item took its estimate: an item starts while its estimate
    fits in the budget left."""
    rows, spent = [], 0.0
    for k, item in enumerate(items, start=1):
        est = estimate_of(item.name, estimates)
        fits = spent + est.seconds <= budget_s
        if fits:
            spent += est.seconds
        rows.append({"order": k, "name": item.name, "headline": item.headline, "estimate_s": est.seconds,
                     "source": est.source, "fits": fits, "starts_at_s": spent - est.seconds if fits else None})
    return rows


def format_plan(rows: list[dict], budget_s: float) -> str:
    width = max([len(r["name"]) + 2 for r in rows] + [4]) + 2
    lines = [f"{'#':>3}  {'item':<{width}}{'estimate s':>11}  {'from':<9}{'starts at s':>12}  in budget"]
    for r in rows:
        start = "-" if r["starts_at_s"] is None else f"{r['starts_at_s']:.0f}"
        lines.append(f"{r['order']:>3}  {r['name'] + (' *' if r['headline'] else ''):<{width}}{r['estimate_s']:>11.0f}  "
                     f"{r['source']:<9}{start:>12}  {'yes' if r['fits'] else 'NO'}")
    run = [r for r in rows if r["fits"]]
    headline = [r for r in rows if r["headline"]]
    lines.append(f"\n* headline item. Budget {budget_s:.0f} s: {len(run)} of {len(rows)} items start, "
                 f"{sum(r['estimate_s'] for r in run):.0f} s by the estimates "
                 f"(at most {CUT_FACTOR * sum(r['estimate_s'] for r in run):.0f} s with every item cut at "
                 f"{CUT_FACTOR:g}x); the headline items {sum(r['estimate_s'] for r in headline):.0f} s, "
                 f"{'all' if all(r['fits'] for r in headline) else 'NOT all'} in budget.")
    return "\n".join(lines)


class Deadline:
    """The moment an item is cut."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


@contextmanager
def cut_at(deadline: Deadline) -> Iterator[None]:
    """Raises ItemCut in the code running here once the deadline passes (an alarm: main thread only)."""
    def alarm(signum, frame):
        raise ItemCut(f"ran past its limit of {deadline.seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(deadline.left(), 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_child(cmd: list[str], deadline: Deadline, what: str, **popen) -> subprocess.CompletedProcess:
    """`cmd` in its own process group, its output captured, killed with all it started (a launcher's
    workers too) when the deadline passes or anything interrupts the wait."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=deadline.left())
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise ItemCut(f"{what} ran past its limit of {deadline.seconds:.0f} s and was killed") from None
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()
