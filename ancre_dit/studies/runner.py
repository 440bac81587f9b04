"""A study's runs on this machine, N at a time, each train.py `--resume auto` in its own subprocess (a
crash in one cannot take the others down). Slot k gets cores // N threads and GPU k % gpus. Output is
appended to `<run>/study.log`. Ctrl-C stops the children as train.py stops (checkpoint, then exit).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .spec import Job, Study
from .status import LOG, record_event, record_exit


@dataclass
class Outcome:
    job: Job
    state: str  # done / stopped / failed
    exit_code: int
    error: str | None = None


def train_command(study: Study, job: Job, train_script: Path) -> list[str]:
    """The command line of one run (every path in it is absolute)."""
    return [sys.executable, str(train_script), "--config", str(study.base), "--resume", "auto", *job.overrides]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def slot_environment(slot: int, slots: int, gpus: int) -> dict[str, str]:
    threads = str(max(1, usable_cores() // slots))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    if gpus and slots > 1:  # one of the GPUs this process sees (of its own CUDA_VISIBLE_DEVICES, if set)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ids[slot % gpus].strip()
    return env


def run_logged(command: list[str], log_path: Path, header: str, started: Callable[[subprocess.Popen], None],
               **popen) -> int:
    """Runs `command`, its output appended to `log_path` after a `=== <time> <header>: <command>` line;
    `started` gets the child once it runs. Polled, not waited on: submitit's signal handler may wait on it too."""
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}: {' '.join(command)}\n")
        log.flush()
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **popen)
        started(child)
        while child.poll() is None:
            time.sleep(0.2)
    return child.returncode


class LocalRunner:
    """Launches the jobs N at a time; `run` returns an Outcome per job launched."""

    def __init__(self, study: Study, train_script: Path, slots: int, is_done: Callable[[Job], bool]):
        self.study, self.train_script, self.slots = study, Path(train_script), max(1, int(slots))
        self.is_done = is_done
        self._children: dict[str, subprocess.Popen] = {}  # dict updates and copy() are atomic
        self._stopping = threading.Event()

    def launch(self, job: Job, env: dict[str, str]) -> Outcome:
        job.run_dir.mkdir(parents=True, exist_ok=True)

        def started(child: subprocess.Popen) -> None:
            self._children[job.name] = child
            record_event(job.run_dir, "started", pid=child.pid, executor="local")

        code = run_logged(train_command(self.study, job, self.train_script), job.run_dir / LOG,
                          f"study {self.study.name}", started, env=env)
        self._children.pop(job.name, None)
        state, error = record_exit(job.run_dir, code, code == 0 and self.is_done(job))
        return Outcome(job, state, code, error)

    def run(self, jobs: Sequence[Job], progress: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        free = list(range(self.slots))  # as many workers as slots: a worker always finds one

        def work(job: Job) -> Outcome | None:
            slot = free.pop(0)  # list.pop and list.append are atomic
            try:
                if self._stopping.is_set():
                    return None
                outcome = self.launch(job, slot_environment(slot, self.slots, gpus))
            finally:
                free.append(slot)
            progress(outcome)
            return outcome

        with ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="study") as pool:
            futures = [pool.submit(work, job) for job in jobs]
            try:
                while not all(f.done() for f in futures):
                    time.sleep(0.2)
            except KeyboardInterrupt:  # SIGTERM to every running child: train.py saves a checkpoint and exits
                self._stopping.set()
                for child in self._children.copy().values():
                    if child.poll() is None:
                        child.send_signal(signal.SIGTERM)
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return [o for f in futures if (o := f.result()) is not None]
