"""The device: the matmul precision every command sets up the same way (training, sampling and evaluation of
the same weights must agree), and the peak dense bf16 throughput that turns counted FLOPs into MFU."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity, vendors' data sheets; SXM parts are the bare names) by a
# fragment of torch.cuda.get_device_name: the first one the name contains wins, so the most specific come first.
PEAK_BF16_TFLOPS = (("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 PCIe", 756.0),
                    ("H100 NVL", 835.0), ("H100", 989.0), ("H800 PCIe", 756.0), ("H800", 989.0), ("H20", 148.0),
                    ("GB200", 2500.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
                    ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("4090", 165.0), ("3090", 71.0),
                    ("V100", 125.0))


def table_peak(name: str) -> tuple[float, str] | None:
    """(peak, fragment) of the first table entry whose fragment `name` contains (case-insensitive)."""
    return next(((value, fragment) for fragment, value in PEAK_BF16_TFLOPS if fragment.lower() in name.lower()), None)


def peak_tflops(device: torch.device | str, override: float | None = None) -> tuple[float | None, str]:
    """(peak dense bf16 TFLOP/s or None when unknown, where the figure came from)."""
    if override:
        return float(override), "given"
    if torch.device(device).type != "cuda":
        return None, "no peak known for a CPU: set it to get an MFU"
    name = torch.cuda.get_device_name(device)
    if (found := table_peak(name)) is None:
        return None, f"unknown device {name!r}: set its peak to get an MFU"
    return found[0], f"table entry {found[1]} ({name})"


def configure_precision(device: torch.device | str, tf32: bool = True) -> None:
    """TF32 for fp32 matrix products and convolutions on CUDA (DiT's setting), set alike by every command."""
    if torch.device(device).type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """Full fp32 products and convolutions meanwhile, for evaluation (TF32 perturbs features; ADM used fp32)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The autocast dtype of a train.mixed_precision setting (None: full precision)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
