"""The one place objective and sampler names are interpreted: `build_objective` builds an objective
from a spec (model_spec.json's or the config's "diffusion" section); `SAMPLERS` maps a sampler name
to how it runs, the objectives it fits and its default step count. A new sampler is its function
(the signature of `SampleFn`) and one entry."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch

from ..errors import UserError, or_list
from .base import Objective
from .ddpm import DDPMObjective, ddpm_sampler, schedule_of, scheduler_sampler
from .flow import FlowObjective
from .flow_samplers import ode_sampler, sde_sampler

OBJECTIVES = ("ddpm", "flow")
# The flow objective's own settings and their defaults (a DDPM spec may hold them only at these).
FLOW_ONLY = {"time_sampling": "uniform", "path": "linear", "prediction": "velocity", "loss_weight": "none",
             "cosine_loss_weight": 0.0}


def build_objective(spec: Mapping[str, Any] | Objective) -> Objective:
    """The objective a spec names under "objective", its other settings defaulting to the objective's."""
    if isinstance(spec, Objective):
        return spec
    name = spec.get("objective")
    if name == "ddpm":
        for key, default in FLOW_ONLY.items():
            if spec.get(key, default) != default:
                raise UserError(f"diffusion.{key}={spec[key]} applies only to diffusion.objective=flow (SiT's "
                                "interpolants); DDPM is DiT's epsilon prediction on uniform integer timesteps: drop it")
        return DDPMObjective(learn_sigma=bool(spec.get("learn_sigma", True)), **schedule_of(spec))
    if name == "flow":
        if spec.get("learn_sigma"):
            raise UserError("the flow objective predicts a velocity and has no learned variance; "
                            "set model.learn_sigma=false")
        return FlowObjective(**{key: spec[key] for key in (*FLOW_ONLY, "logit_mean", "logit_std") if key in spec})
    raise UserError(f"unknown diffusion objective {name!r}; choose {' or '.join(OBJECTIVES)}")


# run(objective, denoiser, x, y, noise, *, steps, sde[, time_shift]) -> data, from noise x
SampleFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class SamplerEntry:
    run: SampleFn
    objectives: tuple[str, ...]  # the objectives (Objective.name) whose networks it can sample
    default_steps: int           # when --steps / eval.steps is not given
    help: str                    # one line, shown in sample.py --help
    # Chooses its own steps from the whole batch: --steps is ignored and a sample depends on the
    # batch it is in (so a compiled job must not pad its last batch).
    adaptive: bool = False
    needs_two_steps: str = ""  # why the sampler needs at least 2 steps ("": it does not)
    shifts_time: bool = False  # runs on a fixed time grid that a time shift bends (run takes time_shift)


SAMPLERS: dict[str, SamplerEntry] = {
    "ddpm": SamplerEntry(ddpm_sampler, ("ddpm",), 250, "ADM's ancestral sampler, respaced ADM-style",
                         needs_two_steps="the ddpm sampler needs at least 2 steps (ADM's posterior at the first "
                                         "step reads the second); use 2 or more, or --sampler ddim for a single step"),
    "ddim": SamplerEntry(partial(scheduler_sampler, kind="ddim"), ("ddpm",), 250, "diffusers' DDIM, eta 0"),
    "dpm-solver": SamplerEntry(partial(scheduler_sampler, kind="dpm-solver"), ("ddpm",), 250,
                               "diffusers' DPM-Solver++(2M)"),
    "euler": SamplerEntry(partial(ode_sampler, method="euler"), ("flow",), 50, "Euler ODE steps", shifts_time=True),
    "heun": SamplerEntry(partial(ode_sampler, method="heun2"), ("flow",), 25,
                         "Heun ODE steps, 2 network calls each", shifts_time=True),
    "dopri5": SamplerEntry(partial(ode_sampler, method="dopri5"), ("flow",), 0,
                           "adaptive Dormand-Prince ODE with SiT's tolerances", adaptive=True),
    "sde": SamplerEntry(sde_sampler, ("flow",), 250, "SiT's Euler-Maruyama; steps count time points",
                        needs_two_steps="the SDE sampler needs at least 2 (SiT counts time points, steps - 1 "
                                        "Euler-Maruyama steps plus the last step)"),
}

def samplers_for(objective: str) -> tuple[str, ...]:
    """The samplers that fit the objective named `objective`, in table order."""
    return tuple(name for name, entry in SAMPLERS.items() if objective in entry.objectives)


def sampler_entry(name: str, setting: str = "sampler") -> SamplerEntry:
    """The table's entry; an unknown name is one UserError naming `setting` and listing the table."""
    if name not in SAMPLERS:
        raise UserError(f"{setting} {name} is unknown; choose {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def check_time_shift(sampler: str, shift: float, name: str = "time_shift") -> None:
    """A time shift is a positive number (1 = none), and only the fixed-grid ODE samplers take one."""
    if not 0 < float(shift) < float("inf"):
        raise UserError(f"{name} {shift} must be a positive number (1 = no shift; LightningDiT samples with 0.3)")
    if float(shift) != 1 and not sampler_entry(sampler).shifts_time:
        takes = [n for n, e in SAMPLERS.items() if e.shifts_time]
        raise UserError(f"{name} {shift} bends a fixed time grid, which sampler {sampler} does not run on; choose "
                        f"{' or '.join(takes)}, or drop the shift")


def resolve_sampler(objective: Objective, sampler: str | None, steps: int | None,
                    names: tuple[str, str] = ("sampler", "steps"), owner: str | None = None) -> tuple[str, int]:
    """(sampler, steps) with the objective's and the sampler's defaults filled in; one UserError,
    calling the two `names`, if the sampler does not fit the objective (`owner`, default: this
    checkpoint) or the step count is out of range."""
    sampler = sampler or objective.default_sampler
    fits = samplers_for(objective.name)
    if sampler not in fits:
        known = "does not fit" if sampler in SAMPLERS else "is unknown for"
        raise UserError(f"{names[0]} {sampler} {known} {owner or f'this {objective.name} checkpoint'}; "
                        f"choose {or_list(fits)}")
    entry = SAMPLERS[sampler]
    steps = entry.default_steps if steps is None else int(steps)
    if not entry.adaptive:  # the sampler's own rule on the step count, then the objective's
        if entry.needs_two_steps and steps < 2:
            raise UserError(f"{names[1]} {steps}: {entry.needs_two_steps}")
        objective.check_steps(steps, names[1])
    return sampler, steps


def sampler_help() -> str:
    """--sampler's help: per objective, its samplers (its default first) with their one-line help."""
    parts = []
    for name in OBJECTIVES:
        default = build_objective({"objective": name}).default_sampler
        names = sorted(samplers_for(name), key=lambda s: s != default)
        listed = ", ".join(f"{s} ({'default; ' if s == default else ''}{SAMPLERS[s].help})" for s in names)
        parts.append(f"{name} checkpoints: {listed}")
    return "; ".join(parts)


def steps_help() -> str:
    """--steps' help: each sampler's default step count."""
    fixed = ", ".join(f"{name} {e.default_steps}" for name, e in SAMPLERS.items() if not e.adaptive)
    adaptive = ", ".join(name for name, e in SAMPLERS.items() if e.adaptive)
    return f"sampling steps (default: {fixed}" + (f"; {adaptive} ignores it)" if adaptive else ")")
