"""The checkpoint folder that sample.py, evaluate.py and user code rebuild a trained model from:
model_spec.json + ema/model.safetensors (model_spec), their readers (weights), published .pt files ->
a folder (importing). Training's resume state beside them is `ancre_dit.training.checkpointing`'s.
"""
from .model_spec import (SPEC_FILE, WEIGHT_FILES, build_model, data_differences, load_model_spec, load_trained_model,
                         make_model_spec, weights_file, write_model_files)
from .importing import import_checkpoint, safe_torch_load
from .weights import damaged, load_safetensors_checked, read_json_checked, save_safetensors
