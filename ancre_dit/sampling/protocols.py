"""What a set of samples was drawn with: the published protocols' presets, and the record written
next to every sample file so that evaluations say which protocol their numbers follow.

A protocol (an entry of PROTOCOLS) is how a source sampled its headline FID: the sampler, its steps and
options, the guided channels and interval, the time shift, the label draw and the precision. `--protocol
NAME` sets them all and refuses a flag that contradicts one; the guidance scale is the headline number's
unless --cfg-scale is given. The sources draw labels at random from per-process seeds, which no other
process count reproduces; ours draws them per sample from --seed (the same distribution, not stream).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..diffusion import build_objective
from ..errors import UserError

_FIXED = {"label_mode": "random", "precision": "fp32"}  # every source below samples so
_SIT_SDE = {"sampler": "sde", "steps": 250, "sde_last_step": "mean", "sde_last_step_size": 0.04,
            "sde_diffusion_norm": 1.0, "time_shift": 1.0}  # SiT's Euler-Maruyama defaults, 250 time points


@dataclass(frozen=True)
class Protocol:
    objective: str              # the objective of the checkpoints it describes
    settings: dict[str, Any]    # JobSettings field -> value
    cfg_scale: float            # the headline number's guidance scale (--cfg-scale overrides)
    describes: str              # whose numbers, in a few words


PROTOCOLS: dict[str, Protocol] = {
    # DiT's sample_ddp.py: 250 respaced DDPM steps, DiT's forward_with_cfg guiding channels 0-2 only.
    "dit": Protocol("ddpm", {**_FIXED, "sampler": "ddpm", "steps": 250, "cfg_channels": 3, "guidance_interval": None,
                             "time_shift": 1.0}, 1.5, "the DiT and ANCRe papers' DDPM-250 numbers"),
    # SiT's sample_ddp.py SDE mode with its defaults; SiT's forward_with_cfg keeps DiT's 3 channels.
    "sit": Protocol("flow", {**_FIXED, **_SIT_SDE, "cfg_channels": 3, "guidance_interval": None}, 1.5,
                    "SiT's SDE-250 numbers (SiT-XL/2, FID 2.06 at cfg 1.5)"),
    # REPA's generate.py --mode sde --num-steps 250 --guidance-high 0.7: SiT's Euler-Maruyama, guiding
    # every channel while t <= 0.7 on its time axis (0 = data, 1 = noise, as our normalised time).
    "repa": Protocol("flow", {**_FIXED, **_SIT_SDE, "cfg_channels": None, "guidance_interval": (0.0, 0.7)}, 1.8,
                     "REPA's SDE-250 numbers (SiT-XL/2 + REPA, FID 1.42 at cfg 1.8)"),
    # LightningDiT's inference.py: Euler on 250 time points (249 steps), timestep_shift 0.3, guidance
    # from cfg_interval_start 0.125 on (u <= 0.875) on the first 3 channels (its forward_with_cfg).
    "lightningdit": Protocol("flow", {**_FIXED, "sampler": "euler", "steps": 249, "time_shift": 0.3,
                                      "cfg_channels": 3, "guidance_interval": (0.0, 0.875)}, 6.7,
                             "LightningDiT's Euler-250 numbers (XL/1 on VA-VAE, 800 epochs, FID 1.35 at cfg 6.7)"),
}


def describe(name: str) -> str:
    """One line of what --protocol NAME sets, for the job's log."""
    p = PROTOCOLS[name]
    shown = ", ".join(f"{key} {value}" for key, value in p.settings.items())
    return f"--protocol {name} ({p.describes}): {shown}; cfg scale {p.cfg_scale} unless --cfg-scale is given"


def apply_protocol(settings, name: str | None):
    """`settings` (a JobSettings) with the protocol's choices; a setting the user changed from its
    default to something else than the protocol's is a one-line error, not silently overridden."""
    if name is None:
        return settings
    if name not in PROTOCOLS:
        raise UserError(f"unknown --protocol {name!r}; choose {', '.join(PROTOCOLS)}")
    wanted = PROTOCOLS[name].settings
    defaults = {f.name: f.default for f in fields(settings)}
    for key, value in wanted.items():
        given = getattr(settings, key)
        if given != value and given != defaults[key]:
            flag = "--random-classes / --classes" if key == "label_mode" else "--" + key.replace("_", "-")
            raise UserError(f"--protocol {name} samples with {key} {value}, but {flag} asks for {given}; "
                            f"drop that flag or drop --protocol")
    if settings.classes is not None:
        raise UserError(f"--protocol {name} draws class labels at random; drop --classes or drop --protocol")
    if settings.guide_ckpt:
        raise UserError(f"--protocol {name} guides classifier-free; drop --guide-ckpt or drop --protocol")
    return replace(settings, **wanted, protocol=name)


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
    p = PROTOCOLS[name]
    objective = build_objective(spec["diffusion"]).name
    if objective != p.objective:
        raise UserError(f"--protocol {name} describes {p.describes}, sampled from {p.objective} checkpoints; this "
                        f"checkpoint was trained with the {objective} objective: drop --protocol or choose one for "
                        f"{objective} ({', '.join(n for n, q in PROTOCOLS.items() if q.objective == objective)})")
    channels = p.settings["cfg_channels"]
    if channels is not None and in_channels < channels:
        raise UserError(f"--protocol {name} guides the first {channels} latent channels; this model has "
                        f"{in_channels} channel(s) (a pixel-space model?): drop --protocol")
