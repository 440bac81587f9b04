"""Worker for tests/test_distributed.py: trains the tiny config with per-sample draws (see
_training_helpers.deterministic_draws). Run under torchrun; argv: overrides."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _training_helpers import TINY, deterministic_draws  # noqa: E402

from ancre_dit.training import Trainer, load_config  # noqa: E402

Trainer.draw_timesteps_and_noise = deterministic_draws
Trainer(load_config(None, [*TINY, *sys.argv[1:]])).run()
