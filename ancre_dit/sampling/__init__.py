"""Class-conditional sampling with classifier-free guidance: samplers, guidance, decoding, and the
sharded, resumable sampling job behind sample.py."""
from .api import SamplingPlan, plan_sampling, sample_images, sample_latents
from .decode import build_decoder, decode_pixels
from .guidance import Guidance, GuidedDenoiser
from .job import JobSettings, run_job
from .noise import SampleNoise, assign_labels, check_classes, sample_seed

__all__ = ["SamplingPlan", "plan_sampling", "sample_images", "sample_latents", "build_decoder", "decode_pixels",
           "Guidance", "GuidedDenoiser", "JobSettings", "run_job", "assign_labels", "check_classes", "SampleNoise",
           "sample_seed"]
