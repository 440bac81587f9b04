"""Objective name -> class, and the one function that builds an objective from a spec (a
checkpoint's model_spec.json "diffusion" section, or the config's diffusion section)."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import UserError
from .base import Objective
from .ddpm import DDPMObjective, schedule_of
from .flow import FlowObjective

OBJECTIVES = ("ddpm", "flow")


def build_objective(spec: Mapping[str, Any] | Objective) -> Objective:
    """The objective a spec names under "objective", its other settings defaulting to the objective's."""
    if isinstance(spec, Objective):
        return spec
    spec = dict(spec)
    name = spec.get("objective")
    if name == "ddpm":
        if spec.get("time_sampling", "uniform") != "uniform":
            raise UserError(f"diffusion.time_sampling={spec['time_sampling']} applies only to diffusion.objective=flow "
                            "(DDPM draws integer timesteps uniformly)")
        return DDPMObjective(learn_sigma=bool(spec.get("learn_sigma", True)), **schedule_of(spec))
    if name == "flow":
        if spec.get("learn_sigma"):
            raise UserError("the flow objective predicts a velocity and has no learned variance; "
                            "set model.learn_sigma=false")
        return FlowObjective(str(spec.get("time_sampling", "uniform")), float(spec.get("logit_mean", 0.0)),
                             float(spec.get("logit_std", 1.0)))
    raise UserError(f"unknown diffusion objective {name!r}; choose {' or '.join(OBJECTIVES)}")
