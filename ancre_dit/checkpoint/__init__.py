"""The checkpoint folder sample.py, evaluate.py and user code rebuild a trained model from: its files and their
readers (model_spec), published .pt files -> a folder (importing). The resume state is training.checkpointing's."""
from .model_spec import (SPEC_FILE, WEIGHT_FILES, build_model, damaged, data_differences, load_model_spec,
                         load_safetensors_checked, load_trained_model, make_model_spec, read_json_checked,
                         save_safetensors, weights_file, write_model_files)
from .importing import import_checkpoint, safe_torch_load
