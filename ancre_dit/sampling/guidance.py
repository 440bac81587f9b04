"""Guidance around a DiT: the network call every sampler makes.

Classifier-free guidance: conditional and unconditional passes share one batched forward (the model's
`forward_with_cfg`). Autoguidance (EDM2's): a weaker model of the same task, a smaller one or an
earlier checkpoint, guides instead, D = D_weak + w (D - D_weak), both conditional. At scale 1, or
outside the guidance interval, only the model runs. The interval is in normalised time u in [0, 1]
(0 = data, 1 = noise; DDPM: t / 999, flow: 1 - t)."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from ..errors import UserError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_guidance_scale(name: str, scale: float) -> None:
    """The one rule for a guidance scale wherever it is given, the error calling it `name` (--cfg-scale,
    train.cfg_scale_for_grids, eval.cfg_scales): finite and >= 0 (1 = the conditional model, 0 = the
    unconditional one)."""
    if not math.isfinite(scale):
        raise UserError(f"{name} {scale} is not a finite number; use 1 for no guidance or a value > 1 (e.g. 1.5)")
    if scale < 0:
        raise UserError(f"{name} {scale} is negative; use 1 for no guidance or a value > 1 (e.g. 1.5)")


@dataclass(frozen=True)
class Guidance:
    """scale: 1 = plain conditional model. channels: guide only the first `channels` epsilon
    channels (3 = the original DiT's behaviour); None = all. interval: guide only at normalised
    times LO <= u <= HI, u in [0, 1], 0 = data, 1 = noise (None = every step). `names`: what the
    caller calls the three values (sample.py: its flags), for the errors."""

    scale: float = 1.0
    channels: int | None = None
    interval: tuple[float, float] | None = None
    names: tuple[str, str, str] = field(default=("guidance scale", "guided channels", "guidance interval"),
                                        compare=False, repr=False)

    def __post_init__(self):
        check_guidance_scale(self.names[0], self.scale)
        if self.channels is not None and self.channels < 1:
            raise UserError(f"{self.names[1]} {self.channels} must be at least 1 (or unset for all channels)")
        if self.interval is None:
            return
        name, (lo, hi) = self.names[2], self.interval
        if not 0 <= lo <= 1 or not 0 <= hi <= 1:
            raise UserError(f"{name} {lo:g},{hi:g} must lie in [0, 1]: it is in normalised time (0 = data, "
                            "1 = noise) for every objective")
        if not lo <= hi:
            raise UserError(f"{name} {lo:g},{hi:g} is empty; give LO,HI with LO <= HI")

    def active_at(self, normalized_time: float) -> bool:
        return self.scale != 1 and (self.interval is None or self.interval[0] <= normalized_time <= self.interval[1])


def parse_interval(text: str | None) -> tuple[float, float] | None:
    """"LO,HI" -> (LO, HI) in normalised time (0 = data, 1 = noise); None/"" -> None."""
    if text is None or str(text).strip() == "":
        return None
    try:
        lo, hi = (float(p) for p in str(text).split(","))
    except ValueError:
        raise UserError(f"guidance interval {text!r} must be LO,HI in normalised time [0, 1], e.g. 0,0.7") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise UserError(f"guidance interval {text!r} holds a number that is not finite; give LO,HI in normalised "
                        "time [0, 1], e.g. 0,0.7")
    return lo, hi


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The DiT inside DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
    return unwrap_model(inner) if isinstance(inner, torch.nn.Module) else model


class GuidedDenoiser:
    """`denoiser(x, t, y)` -> the model output (C or 2C channels) with guidance applied, float32. t holds the
    objective's model times, the same for the whole batch; `normalized_time` (the objective's) maps them to
    the guidance interval's unit. With `guide` (autoguidance), that model's output on the first C channels
    stands in for the unconditional one; the model's learned variance, if any, is kept as it is."""

    def __init__(self, model: torch.nn.Module, guidance: Guidance, precision: str = "fp32",
                 normalized_time: Callable[[float], float] | None = None, compile: bool = False,
                 guide: torch.nn.Module | None = None):
        self.model = unwrap_model(model)
        self.guide = None if guide is None else unwrap_model(guide)
        # Static shapes: the job pads its last batch, so each path compiles once; dynamic shapes would
        # trade the fastest kernels for a graph that fits any batch.
        wrap = partial(torch.compile, dynamic=False) if compile else (lambda fn: fn)
        self._forward = wrap(self.model)
        # looked up when called: a model that is never guided needs no forward_with_cfg
        self._forward_with_cfg = wrap(lambda *a, **k: self.model.forward_with_cfg(*a, **k))
        if self.guide is not None:
            for name in ("in_channels", "input_size", "num_classes"):  # the weak model denoises the same inputs
                mine, theirs = int(getattr(self.model, name)), int(getattr(self.guide, name))
                if mine != theirs:
                    raise UserError(f"the guiding model has {name} {theirs}, the sampled model {mine}; autoguidance "
                                    "needs a model of the same latent space and classes (a smaller model or an "
                                    "earlier checkpoint of the same run)")
            self._guide = wrap(self.guide)
        self.guidance, self.normalized_time = guidance, normalized_time
        if precision not in PRECISIONS:
            raise UserError(f"unknown sampling precision {precision!r}; choose {', '.join(PRECISIONS)}")
        self.dtype = PRECISIONS[precision]
        self.num_classes = int(self.model.num_classes)
        if (guidance.scale != 1 and self.guide is None
                and self.model.y_embedder.embedding_table.num_embeddings <= self.num_classes):
            raise UserError("this model was trained without class dropout, so it has no unconditional mode for "
                            f"guidance (scale {guidance.scale:g}); use guidance scale 1")
        if guidance.channels is not None and guidance.channels > self.model.in_channels:
            raise UserError(f"guided channels {guidance.channels} exceed the model's {self.model.in_channels} channels")
        self.calls = 0  # network forwards, counted per sample (for tests and benchmarks)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.guidance
        # fp32 enters no autocast at all: autocast(enabled=False) would also switch off a caller's.
        with contextlib.nullcontext() if self.dtype is None else torch.autocast(x.device.type, dtype=self.dtype):
            if not g.active_at(self.normalized_time(float(t[0])) if g.interval is not None else 0.0):
                self.calls += len(x)
                return self._forward(x, t, y).float()
            self.calls += 2 * len(x)
            if self.guide is not None:
                out, weak = self._forward(x, t, y).float(), self._guide(x, t, y).float()
                k = g.channels or x.shape[1]
                return torch.cat([weak[:, :k] + g.scale * (out[:, :k] - weak[:, :k]), out[:, k:]], dim=1)
            null = torch.full_like(y, self.num_classes)
            out = self._forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), g.scale,
                                         guided_channels=g.channels)
        return out[: len(x)].float()
