"""Training: typed config, data order and adapters, atomic checkpoints, the Accelerate loop."""
from .config import Config, load_config
from .trainer import Trainer, train

__all__ = ["Config", "load_config", "Trainer", "train"]
