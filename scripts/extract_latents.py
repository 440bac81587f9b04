"""Encode ImageNet-style images into VAE latent shards (resumable; one or many processes).

    python scripts/extract_latents.py --data-path IMAGENET/train --vae VAE_DIR --out LATENT_DIR
    python scripts/extract_latents.py --data-path HF_DATASET_DIR ...     # save_to_disk folder or parquet files
    python scripts/extract_latents.py --data-path 'SHARDS/imagenet-train-{0000..1023}.tar' ...   # WebDataset
    accelerate launch --num_processes 8 scripts/extract_latents.py --data-path ... --vae-dtype bf16
    python scripts/extract_latents.py --verify LATENT_DIR
    python scripts/extract_latents.py ... --keep-images     # also the uint8 crops, for REPA (3 x S x S bytes each)

Rerunning the same command after a crash keeps every finished shard and writes the rest.
"""
from __future__ import annotations

import argparse
import os
import sys

from ancre_dit.cli import CommandParser, run_cli
from ancre_dit.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", help="an image folder (one subfolder per class; labels: sorted folder order), a "
                   "Hugging Face dataset (save_to_disk folder or a folder of parquet files) or WebDataset tar shards "
                   "(a folder of .tar files or a brace pattern)")
    p.add_argument("--format", choices=["imagefolder", "hf", "wds"], default=None,
                   help="the container of --data-path (default: detected from the path)")
    p.add_argument("--image-column", default="image", help="Hugging Face datasets: the image column (default image)")
    p.add_argument("--label-column", default="label",
                   help="Hugging Face datasets: the label column (default label; class names from its ClassLabel)")
    p.add_argument("--vae", help="local diffusers VAE folder, AutoencoderKL (any channel count) or AutoencoderDC "
                   "(or a hub id, if you have network)")
    p.add_argument("--out", help="output folder for manifest.json + shard-XXXXX.safetensors")
    p.add_argument("--image-size", type=int, default=256, help="ADM center-crop size (default 256)")
    p.add_argument("--shard-size", type=int, default=5000, help="images per shard (default 5000)")
    p.add_argument("--batch-size", type=int, default=32, help="images per VAE batch; each is encoded with its flip (default 32)")
    p.add_argument("--num-workers", type=int, default=-1,
                   help="image decoding workers per process (default: 0 on CPU, min(8, cores per process - 1) on GPU)")
    p.add_argument("--vae-dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="VAE precision; fp16/bf16 on GPU only")
    p.add_argument("--scaling-factor", type=float, default=None, help="override the VAE config's scaling_factor")
    p.add_argument("--min-side", type=int, default=8, help="skip images whose shorter side is below this (default 8)")
    p.add_argument("--max-shards", type=int, default=None, help="stop after writing this many new shards per process")
    p.add_argument("--keep-images", action="store_true",
                   help="also store each uint8 centre crop in its shard, for REPA (repa.weight > 0): 3 x S x S "
                        "bytes per image, about 196 KB at 256 px (250 GB for ImageNet's 1.28M)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    p.add_argument("--verify", metavar="LATENT_DIR", help="check a finished shard set and exit (non-zero if anything is wrong)")
    return p.parse_args(argv)


def verify(root: str) -> int:
    from ancre_dit.latents.shards import verify_latent_dir

    manifest, problems = verify_latent_dir(root)
    for line in problems:
        print(line)
    if problems:
        print(f"{root}: {len(problems)} problem(s) in {manifest['num_shards']} shards; rerun the extraction "
              "command to rewrite corrupt or missing shards", file=sys.stderr)
        return 1
    print(f"{root}: {manifest['num_shards']} shards, {manifest['num_images']} images, all checksums and shapes OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify:
        return verify(args.verify)
    missing = [f"--{n.replace('_', '-')}" for n in ("data_path", "vae", "out") if not getattr(args, n)]
    if missing:
        raise UserError(f"missing {', '.join(missing)}; usage: extract_latents.py --data-path IMAGES --vae VAE_DIR "
                        "--out LATENT_DIR (or --verify LATENT_DIR)")
    from ancre_dit.cli import job_processes, output_folder
    from ancre_dit.latents.extract import DistContext, ExtractConfig, run_extraction

    # A rerun resumes its own folder (manifest or shards there); any other non-empty folder is refused.
    output_folder(args.out, "latent folder", ("manifest.json", "shard-*.safetensors*"))

    with job_processes(args.cpu) as state:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != state.num_processes:
            raise UserError(f"launched as {launched} processes but accelerate set up {state.num_processes}; "
                            "launch with `accelerate launch` or `torchrun` (set ACCELERATE_USE_CPU=1 on CPU)")
        workers = args.num_workers
        if workers < 0:
            per_process = (os.cpu_count() or 1) // state.num_processes
            workers = min(8, max(0, per_process - 1)) if state.device.type == "cuda" else 0
        cfg = ExtractConfig(data_path=args.data_path, vae=args.vae, out=args.out, image_size=args.image_size,
                            shard_size=args.shard_size, batch_size=args.batch_size, num_workers=workers,
                            vae_dtype=args.vae_dtype, scaling_factor=args.scaling_factor, min_side=args.min_side,
                            max_shards=args.max_shards, keep_images=args.keep_images,
                            data_format=args.format, image_column=args.image_column, label_column=args.label_column)
        run_extraction(cfg, DistContext(rank=state.process_index, world=state.num_processes, device=state.device,
                                        barrier=state.wait_for_everyone))
    return 0


if __name__ == "__main__":
    run_cli(main)
