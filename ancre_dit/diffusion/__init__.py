"""Training objectives and their samplers: DDPM (DiT) and flow matching (SiT), behind one interface."""
from .base import LAST_STEPS, Objective, SDEOptions
from .ddpm import DDPMObjective
from .flow import TIME_SAMPLINGS, FlowObjective
from .sampler_registry import (OBJECTIVES, SAMPLERS, SamplerEntry, build_objective, check_time_shift, resolve_sampler,
                               samplers_for)
