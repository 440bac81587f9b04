"""The checkpoint folder: what sample.py, evaluate.py and user code read to rebuild a trained model.

    folder     model_spec.json (architecture, diffusion, data) + ema/model.safetensors: write, read, load
    weights    readers of weight and metadata files that name a damaged file in one line
    importing  published .pt checkpoints (the DiT release, official ANCRe runs) -> a checkpoint folder

Training's own resume state (Accelerate's optimizer and RNG state) sits beside these files and is
handled by `ancre_dit.training.checkpointing`.
"""
from .model_spec import (SPEC_FILE, WEIGHT_FILES, build_model, data_differences, load_model_spec, load_trained_model,
                         make_model_spec, weights_file, write_model_files)
from .importing import import_checkpoint, safe_torch_load
from .weights import damaged, load_safetensors_checked, read_json_checked, save_safetensors
