"""What a set of samples was drawn with: the published protocol's preset, and the record written
next to every sample file so that evaluations say which protocol their numbers follow.

`dit`, the protocol of the DiT and ANCRe papers' numbers: class labels drawn at random (not
balanced), 250 respaced DDPM steps, guidance on the first 3 latent channels only (a quirk of DiT's
sampling script that the published numbers include), fp32; the guidance scale stays a flag (the
papers report cfg 1.0 and 1.5)."""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..diffusion import build_objective
from ..errors import UserError

PROTOCOL = "dit"  # the one protocol; --protocol names it so that more can follow
# setting -> (the protocol's value, the flag that sets it)
DIT_SETTINGS: dict[str, tuple[Any, str]] = {
    "sampler": ("ddpm", "--sampler"), "steps": (250, "--steps"), "cfg_channels": (3, "--cfg-channels"),
    "label_mode": ("random", "--random-classes / --classes"), "precision": ("fp32", "--precision"),
    "guidance_interval": (None, "--guidance-interval")}
DIT_NEEDS = "DiT's DDPM-250 protocol for 4-channel latent models (guidance on the first 3 channels)"


def apply_protocol(settings, name: str | None):
    """`settings` (a JobSettings) with the protocol's choices; a setting the user changed from its
    default to something else than the protocol's is a one-line error, not silently overridden."""
    if name is None:
        return settings
    if name != PROTOCOL:
        raise UserError(f"unknown --protocol {name!r}; choose {PROTOCOL}")
    defaults = {f.name: f.default for f in fields(settings)}
    for key, (wanted, flag) in DIT_SETTINGS.items():
        given = getattr(settings, key)
        if given != wanted and given != defaults[key]:
            raise UserError(f"--protocol {name} samples with {key} {wanted}, but {flag} asks for {given}; "
                            f"drop that flag or drop --protocol")
    if settings.classes is not None:
        raise UserError(f"--protocol {name} draws class labels at random; drop --classes or drop --protocol")
    if settings.guide_ckpt:
        raise UserError(f"--protocol {name} guides classifier-free; drop --guide-ckpt or drop --protocol")
    return replace(settings, **{key: wanted for key, (wanted, _) in DIT_SETTINGS.items()}, protocol=name)


def record_path(samples: str | Path) -> Path:
    """The sampling record of samples.npz: samples.sampling.json next to it."""
    return Path(samples).with_suffix(".sampling.json")


def read_sampling_record(samples: str | Path) -> dict[str, Any] | None:
    """The settings samples.npz was drawn with, or None (a file not written by sample.py)."""
    path = record_path(samples)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}); delete it or rewrite it with sample.py") from None


def check_protocol_fits(name: str | None, spec: dict[str, Any], in_channels: int) -> None:
    """A protocol asked of a checkpoint it does not describe is one line naming the protocol and
    what it needs, not an error about a flag the user never passed."""
    if name is None:
        return
    objective = build_objective(spec["diffusion"]).name
    if objective != "ddpm":
        raise UserError(f"--protocol {name} is {DIT_NEEDS}; this checkpoint was trained with the {objective} "
                        f"objective: drop --protocol and choose a {objective} sampler with --sampler")
    if in_channels < DIT_SETTINGS["cfg_channels"][0]:
        raise UserError(f"--protocol {name} is {DIT_NEEDS}; this model has {in_channels} channel(s) "
                        f"(a pixel-space model?): drop --protocol")
