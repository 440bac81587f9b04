"""Images -> VAE latent shards (scripts/extract_latents.py); the reader is ancre_dit.data.latent_shards.

image_datasets.py lists the image containers, shards.py writes, checksums and verifies the shard files,
extract.py runs one process's share of the work."""
