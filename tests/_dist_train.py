"""Worker for tests/test_distributed.py: trains the tiny config with per-sample draws (see
helpers.deterministic_draws). Run under torchrun as a script, so this folder (and helpers.py) is
on sys.path; argv: overrides."""
import sys

from helpers import TINY_TRAIN, deterministic_draws

from ancre_dit.training import Trainer, load_config

Trainer.draw_timesteps_and_noise = deterministic_draws
Trainer(load_config(None, [*TINY_TRAIN, *sys.argv[1:]])).run()
