"""Fixtures shared by the whole suite; the plain functions behind them live in tests/helpers.py
(``from helpers import ...`` works in any test file and in the scripts the tests launch).

Models and inputs: the plain functions of tests/helpers.py (``tiny_model(topology, seed, **overrides)``,
THE tiny DiT of the suite; ``randomize``; ``inputs``), imported where needed.

Training
  tiny_run_config factory ``tiny_run_config(*overrides, run_dir=None) -> Config``: the tiny model
                  trained on digits (helpers.TINY_TRAIN: 16 per batch, no sampling, a metrics line per
                  step), writing to ``tmp_path / "run"`` unless run_dir is given; helpers.tiny_config
                  is the same with run_dir first.
  fresh_accelerate  resets Accelerate's process-wide state before and after the test; use it (or
                  ``pytestmark = pytest.mark.usefixtures("fresh_accelerate")``) for in-process training.
                  A test that runs several trainers or commands in one process runs each in
                  ``with helpers.accelerate_state():`` (the same resets around one block).

Processes and threads
  one_thread      runs the test with one torch thread (faster for tiny models beside other load, and
                  the thread count of a torchrun worker, so results match bit for bit).

Parallel runs: under pytest-xdist (``-n auto``, what scripts/run_tests.sh does) each worker runs
torch on one thread, so N workers use N cores instead of N x cores threads. The modules that hold
the longest tests run first (LONGEST_FIRST), so that no worker is left with a minutes-long test
while the others have nothing left to take.

Markers: ``@pytest.mark.slow`` for a test over ~2 s (training runs, subprocesses, torch.compile);
``python -m pytest -m "not slow" -n auto`` is the quick loop, ``bash scripts/run_tests.sh`` runs everything.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import helpers
from ancre_dit.training.config import Config


# The modules with the longest tests (`pytest --durations=30`), longest first. Each module keeps its
# own order and stays in one piece, so its module-scoped fixtures are built once.
LONGEST_FIRST = ("test_preemption.py", "test_gpu_check.py", "test_grad_checkpointing.py", "test_study.py",
                 "test_resume_layouts.py", "test_bench_quickstart.py", "test_latents.py", "test_distributed.py")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: a thread each
        torch.set_num_threads(1)
    # No tqdm monitor thread: the suite forks children, and a fork while that thread holds the bars'
    # lock would hand the child a lock that nobody can release.
    from tqdm import tqdm
    tqdm.monitor_interval = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def tiny_run_config(tmp_path: Path) -> Callable[..., Config]:
    def make(*overrides: str, run_dir: Path | None = None) -> Config:
        return helpers.tiny_config(run_dir or tmp_path / "run", *overrides)
    return make


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    with helpers.accelerate_state():
        yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    with helpers.one_torch_thread():
        yield
