"""Training objectives and their samplers: DDPM (DiT) and flow matching (SiT), behind one interface."""
from .base import LAST_STEPS, Objective, SDEOptions
from .ddpm import DDPMObjective
from .flow import TIME_SAMPLINGS, FlowObjective
from .sampler_registry import (OBJECTIVES, SAMPLERS, SamplerEntry, build_objective, check_time_shift, resolve_sampler,
                               samplers_for)

__all__ = ["LAST_STEPS", "Objective", "SDEOptions", "DDPMObjective", "TIME_SAMPLINGS", "FlowObjective", "OBJECTIVES",
           "build_objective", "SAMPLERS", "SamplerEntry", "check_time_shift", "resolve_sampler", "samplers_for"]
