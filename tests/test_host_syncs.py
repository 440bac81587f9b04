"""The training step reads nothing back to the host between log steps.

On a GPU every `.item()`, `float(t)`, `bool(t)`, `.tolist()` or `.cpu()` of a device tensor waits
for the queue to drain; on a CPU it costs nothing, so no timing shows it: the reads are counted.
A read counts when the code that makes it is the package's own (the data pipeline, which reads
host tensors in its workers, and the stop agreement, an all-reduce of a host integer over gloo,
are left out)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch.overrides import TorchFunctionMode

from helpers import reset_accelerate, tiny_config

import ancre_dit
from ancre_dit.training import Trainer

PACKAGE = Path(ancre_dit.__file__).parent
NOT_COUNTED = {PACKAGE / "training" / "data.py", PACKAGE / "training" / "stopping.py"}
DATA = PACKAGE / "data"  # the datasets: host tensors, in the loader's workers when it has any
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}


class HostReadCounter(TorchFunctionMode):
    """Records where the package reads a tensor back to the host while `active`."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.active and getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame is not None and "torch" in Path(frame.f_code.co_filename).parts:
                frame = frame.f_back
            path = Path(frame.f_code.co_filename) if frame is not None else None
            if path is not None and PACKAGE in path.parents and DATA not in path.parents and path not in NOT_COUNTED:
                self.reads.append(f"{path.relative_to(PACKAGE)}:{frame.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [(), ("train.grad_clip=1.0", "train.ema_warmup=true", "train.warmup_steps=3")],
                         ids=["default", "clip-warmup"])
@pytest.mark.slow
def test_no_host_read_in_steps_that_log_nothing(tmp_path, monkeypatch, overrides):
    counter = HostReadCounter()
    log_every, max_steps = 4, 9
    by_step: dict[int, list[str]] = {}
    real_step = Trainer.train_step

    def step(self, batches):
        # The reads after step k's train_step (its logging, tasks, stop check) are step k's too:
        # each step's list runs from its train_step to the next one's.
        counter.reads = by_step.setdefault(self.step + 1, [])
        return real_step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", step)
    reset_accelerate()
    try:
        trainer = Trainer(tiny_config(tmp_path / "run", f"train.max_steps={max_steps}", f"train.log_every={log_every}",
                                      "train.ckpt_every=1000", *overrides))
        with counter:
            counter.active = True
            trainer.run()
    finally:
        reset_accelerate()
    quiet = {s: reads for s, reads in by_step.items() if s % log_every and s != max_steps}
    logged = {s: reads for s, reads in by_step.items() if s not in quiet}
    assert sorted(quiet) == [1, 2, 3, 5, 6, 7] and sorted(logged) == [4, 8, 9]
    assert not any(quiet.values()), quiet
    # The counter sees reads where they belong: the log steps read the terms and the guard's flags.
    assert all(logged.values()), logged
