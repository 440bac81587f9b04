"""Class-conditional sampling with classifier-free guidance: samplers, guidance, decoding, and the
sharded, resumable sampling job behind sample.py."""
from .api import (SampleNoise, SamplingPlan, assign_labels, build_decoder, check_classes, decode_pixels, plan_sampling,
                  sample_images, sample_latents, sample_seed)
from .guidance import Guidance, GuidedDenoiser
from .job import JobSettings, run_job
