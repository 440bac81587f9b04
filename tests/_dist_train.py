"""Worker for the multi-process tests (tests/test_distributed.py, tests/test_preemption.py): trains
the tiny config with per-sample draws (helpers.train_tiny). Run under torchrun or `accelerate
launch` as a script, so this folder (and helpers.py) is on sys.path.
argv: overrides, and `--resume auto` to continue the run. ANCRE_TEST_STEP_SECONDS slows every step
down by that much, so that a test can signal a run in the middle."""
import os
import sys
import time

from helpers import train_tiny

from ancre_dit.training import Trainer

pause = float(os.environ.get("ANCRE_TEST_STEP_SECONDS", "0"))
if pause:
    real_step = Trainer.train_step

    def slow_step(self, batches):
        time.sleep(pause)
        return real_step(self, batches)

    Trainer.train_step = slow_step
args = sys.argv[1:]
resume = None
if "--resume" in args:
    k = args.index("--resume")
    resume = args[k + 1]
    del args[k:k + 2]
train_tiny(*args, resume=resume)
