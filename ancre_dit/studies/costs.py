"""Training FLOPs per step of each arm, so arms of different cost compare at equal compute and a study
is priced before it runs (`study.py run --dry-run`). Counted once per model (models.flops) from an arm's
checkpoint (the exact model trained) or, before any, its config; cached in `<out>/flops.json`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from ..checkpoint import WEIGHT_FILES, load_model_spec
from ..errors import UserError
from ..files import write_atomic
from ..training.checkpointing import list_checkpoints

CACHE = "flops.json"
MICRO_BATCH = 2
_COUNTED: dict[str, float] = {}  # per process: a study's arms and seeds share a few models


def flops_per_image(model_spec: dict[str, Any], topology_state: dict[str, Any] | None = None) -> float:
    """Training FLOPs of one image through a model spec's model (`topology_state`: its `topology.*` tensors)."""
    from ..checkpoint import build_model
    from ..models.flops import flops_per_training_image

    key = json.dumps(model_spec["model"], sort_keys=True)
    if key not in _COUNTED:
        kwargs = model_spec["model"]["kwargs"]

        def build(device: str):
            state = None if topology_state is None else {k: v.to(device) for k, v in topology_state.items()}
            return build_model(model_spec, state)

        _COUNTED[key] = flops_per_training_image(build, int(kwargs.get("in_channels", 4)),
                                                 int(kwargs.get("input_size", 32)), batch=MICRO_BATCH)
    return _COUNTED[key]


def _saved_model(run_dirs: Sequence[Path]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(model spec, topology tensors) of the newest readable checkpoint of the runs."""
    from safetensors import SafetensorError, safe_open

    for run_dir in run_dirs:
        if saved := list_checkpoints(run_dir):
            try:
                spec = load_model_spec(saved[-1][1])
                with safe_open(str(saved[-1][1] / WEIGHT_FILES["model"]), "pt") as f:
                    return spec, {k: f.get_tensor(k) for k in f.keys() if k.startswith("topology.")}
            except (UserError, SafetensorError, OSError):
                continue
    return None


def arm_flops_per_step(out: Path, arms: dict[str, tuple[Sequence[Path], int]]) -> dict[str, float | None]:
    """arm -> training FLOPs per step (None before any checkpoint); `arms`: arm -> (run folders, batch)."""
    cache_path = out / CACHE
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        cache = {}  # a derived file: recounted
    counted = dict(cache.get("per_image", {}))
    result: dict[str, float | None] = {}
    for arm, (run_dirs, batch) in arms.items():
        result[arm] = None
        if (saved := _saved_model(run_dirs)) is not None:  # (model spec, topology tensors)
            key = json.dumps(saved[0]["model"], sort_keys=True)
            if key not in counted:
                counted[key] = flops_per_image(*saved)
            result[arm] = counted[key] * batch
    record = {"per_image": counted, "per_step": result,
              "note": "network forward + backward (matrix products), per image x train.global_batch_size"}
    if record != cache:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_path, json.dumps(record, indent=1).encode())
    return result


DEFAULT_MFU = 0.40          # the GPU check's target for DiT-B/2 training, compiled, bf16
DEFAULT_GPU = "H100"        # a key of ancre_dit.hardware.PEAK_BF16_TFLOPS
IMAGENET_CLASSES = 1000     # latents whose manifest is not at hand are taken as ImageNet's
SD_VAE = (8, 4)             # (downsampling, channels) of the SD VAE the recipes name


class ComputeRate(NamedTuple):
    """The sustained training rate, mfu x peak, and where each figure came from."""
    mfu: float
    peak_tflops: float
    source: str


def compute_rate(mfu: float | None = None, peak_tflops: float | None = None, gpu: str | None = None,
                 gpu_check: str | Path | None = None) -> ComputeRate:
    """Flags first, then a gpu_check.json's "trainer" figures, then DEFAULT_MFU of a DEFAULT_GPU."""
    if mfu is not None and not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu} must be a fraction in (0, 1], e.g. --mfu 0.4 for 40%")
    if peak_tflops is not None and not peak_tflops > 0:
        raise UserError(f"--gpu-peak-tflops {peak_tflops} must be positive, e.g. 989 for an H100")
    measured: dict[str, Any] = {}
    if gpu_check is not None:
        try:
            measured = json.loads(Path(gpu_check).read_text()).get("trainer") or {}
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise UserError(f"--gpu-check {gpu_check} is not a readable gpu_check.json ({err}); pass the file "
                            f"benchmarks/gpu_check.py wrote") from None
        if not measured.get("mfu"):
            raise UserError(f"--gpu-check {gpu_check} holds no trainer MFU (its \"trainer\" section is missing or has "
                            f"none); rerun the GPU check on a GPU, or give --mfu")
    mfu_source, peak_source = "MFU given", "peak given"
    if mfu is None:
        mfu, mfu_source = ((float(measured["mfu"]), f"MFU measured by the GPU check ({gpu_check})") if measured
                           else (DEFAULT_MFU, f"default MFU {DEFAULT_MFU:.0%}"))
    if peak_tflops is None and gpu is None and measured.get("peak_tflops"):
        peak_tflops = float(measured["peak_tflops"])
        peak_source = f"peak of the GPU check's device {measured.get('device', '')}".rstrip()
    elif peak_tflops is None:
        from ..hardware import PEAK_BF16_TFLOPS, table_peak

        if (found := table_peak(gpu or DEFAULT_GPU)) is None:
            known = ", ".join(f for f, _ in PEAK_BF16_TFLOPS)
            raise UserError(f"--gpu {gpu or DEFAULT_GPU}: no peak known for it (known: {known}); give its dense "
                            f"bf16 peak with --gpu-peak-tflops")
        peak_tflops = found[0]
        peak_source = f"peak of {gpu} from the device table" if gpu else f"peak of an {DEFAULT_GPU}/H200 (default)"
    return ComputeRate(mfu, peak_tflops, f"{mfu_source}; {peak_source}")


def data_shape(config) -> tuple[int, int, int, str]:
    """(input side, channels, classes, how found) of a config's data, without opening it (it may be elsewhere)."""
    d = config.data
    if d.kind == "digits":
        from ..data.digits import DIGITS_NUM_CLASSES
        return 8, 1, DIGITS_NUM_CLASSES, "digits"
    if d.kind == "latents":
        from ..data.latent_shards import read_manifest
        try:
            m = read_manifest(d.path)
            c, h, _ = (int(s) for s in m["latent_shape"])
            return h, c, int(m["num_classes"]), "the latents' manifest"
        except (UserError, KeyError, TypeError, ValueError):
            down, channels = SD_VAE
            return d.image_size // down, channels, IMAGENET_CLASSES, "assumed: SD-VAE latents of ImageNet"
    return d.image_size, 3, IMAGENET_CLASSES, "assumed: 1000 classes"


def config_flops_per_step(config) -> float:
    """Training FLOPs of one step of the network a config builds."""
    from ..training.model_setup import model_kwargs

    size, channels, classes, _ = data_shape(config)
    spec = {"name": config.model.name, "kwargs": model_kwargs(config.model, size, channels, classes)}
    return flops_per_image({"model": spec}) * config.train.global_batch_size


def format_bill(rows: list[tuple[str, int, float, int]], rate: ComputeRate) -> str:
    """rows: (arm, runs, FLOPs per step, steps per run) -> the table and the study's total."""
    from .status import format_table

    per_second = rate.mfu * rate.peak_tflops * 1e12
    table, total = [], 0.0
    for arm, runs, per_step, steps in rows:
        flops = per_step * steps * runs
        total += flops
        table.append((arm, runs, f"{per_step / 1e12:.3g}", steps, f"{flops / 1e18:.4g}",
                      f"{flops / per_second / 3600:,.1f}"))
    head = ("arm", "runs", "TFLOP/step", "steps/run", "EFLOP (all runs)", "GPU-hours")
    hours = total / per_second / 3600
    return (f"training compute at {rate.mfu:.0%} MFU of {rate.peak_tflops:g} TFLOP/s per GPU ({rate.source}; "
            f"network forward + backward only: no optimizer, EMA, REPA encoder, evaluation or recomputation):\n"
            f"{format_table(head, table)}\n"
            f"total: {total / 1e18:.4g} EFLOP = {hours:,.1f} GPU-hours ({hours / 24:,.1f} GPU-days)")
