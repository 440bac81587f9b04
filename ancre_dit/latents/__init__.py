"""Images -> VAE latent shards (scripts/extract_latents.py); the reader is ancre_dit.data.latent_shards.

image_datasets.py lists the image containers, shards.py writes and checksums, extract.py runs one
process's share of the work, verify.py checks a finished set.
"""
from .extract import DistContext, ExtractConfig, ExtractResult, run_extraction
from .verify import verify_latent_dir

__all__ = ["DistContext", "ExtractConfig", "ExtractResult", "run_extraction", "verify_latent_dir"]
