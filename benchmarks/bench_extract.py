"""Benchmark: images/s of latent extraction (not a test).

Builds a temporary image folder (JPEGs of about ImageNet's average size) and VAEs with random
weights: the tiny test VAE and the real SD-VAE architecture (sd-vae-ft-ema's config). For each it
prints three rates: decoding + ADM crop alone, VAE encoding alone (each image = itself + its flip),
and the whole extraction (scripts/extract_latents.py's code path, shards written).

    python -m benchmarks.bench_extract                                  # CPU, a few images
    python -m benchmarks.bench_extract --device cuda --vae-dtype bf16 --sd-images 512 --batch-size 64 --num-workers 8
    python -m benchmarks.bench_extract --containers imagefolder,hf,parquet,wds --tiny-images 256 --batch-size 32

With --containers, the same JPEGs are also stored as a Hugging Face dataset (save_to_disk), a
parquet folder and WebDataset tars, and each container is timed (listing, decoding + crop alone,
and the whole extraction with the tiny VAE); the shards of every container are checked to be
bitwise those of the image folder.

The tiny VAE runs at 32 px by default: its attention block works at half the crop size, so at
256 px it attends over 128x128 positions and is slower than the real SD-VAE.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ancre_dit.cli import run_cli
from ancre_dit.latents.extract import DistContext, ExtractConfig, run_extraction
from ancre_dit.data.image_folder import CroppedImages, list_image_folder
from ancre_dit.latents.image_datasets import open_source
from ancre_dit.vae import DTYPES, encode_moments, load_vae

ARCHS = {
    "tiny": dict(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                 up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                 norm_num_groups=8, sample_size=32),
    # stabilityai/sd-vae-ft-ema's config.json (random weights here: speed does not depend on them)
    "sd-vae": dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                   up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4,
                   norm_num_groups=32, sample_size=256),
}


def make_images(root: Path, count: int, seed: int = 0) -> None:
    """JPEGs of 500x375 / 375x500 (ImageNet's most common sizes): smooth colour fields plus noise,
    so decoding costs what natural photos cost rather than what pure noise costs."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        w, h = (500, 375) if i % 3 else (375, 500)
        yy, xx = np.mgrid[:h, :w] / max(h, w)
        phase = rng.uniform(0, 6, size=3)
        img = np.stack([127 + 100 * np.sin(5 * xx + 3 * yy + p) for p in phase], axis=-1)
        img += rng.normal(0, 12, size=img.shape)
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(folder / f"{i:05d}.JPEG", quality=90)


def bench(arch: str, n: int, image_size: int, args: argparse.Namespace, work: Path) -> None:
    from diffusers import AutoencoderKL

    data = work / f"images-{n}"
    if not data.exists():
        make_images(data, n)
    vae_dir = work / f"vae-{arch}"
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, **ARCHS[arch]).save_pretrained(vae_dir)
    device = torch.device(args.device)

    # 1) decoding + crop alone (one process, no workers)
    images = CroppedImages(list_image_folder(data), image_size, min_side=8)
    t0 = time.perf_counter()
    crops = [images[i].array for i in range(len(images))]
    decode_rate = n / (time.perf_counter() - t0)

    # 2) VAE alone: batches of `batch_size` images, each with its flip; first batch is warm-up
    loaded = load_vae(str(vae_dir), device, DTYPES[args.vae_dtype])
    pixels = torch.from_numpy(np.stack(crops))
    batches = [pixels[i:i + args.batch_size] for i in range(0, n, args.batch_size)]
    batch = batches[0]
    encode_moments(loaded, torch.cat([batch, batch.flip(2)]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in batches:
        encode_moments(loaded, torch.cat([batch, batch.flip(2)]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    encode_rate = n / (time.perf_counter() - t0)

    # 3) the whole extraction (listing, VAE load, decode, encode, shard writes, manifest)
    out = work / f"latents-{arch}"
    cfg = ExtractConfig(data_path=str(data), vae=str(vae_dir), out=str(out), image_size=image_size,
                        shard_size=args.shard_size, batch_size=args.batch_size, num_workers=args.num_workers,
                        vae_dtype=args.vae_dtype)
    t0 = time.perf_counter()
    run_extraction(cfg, DistContext(device=device))
    total_rate = n / (time.perf_counter() - t0)
    shutil.rmtree(out)
    params = sum(p.numel() for p in loaded.vae.encoder.parameters()) + sum(
        p.numel() for p in loaded.vae.quant_conv.parameters())
    print(f"RESULT arch={arch} encoder_params={params / 1e6:.2f}M device={device} dtype={args.vae_dtype} "
          f"image_size={image_size} images={n} batch={args.batch_size} workers={args.num_workers} "
          f"threads={torch.get_num_threads()} | decode+crop {decode_rate:.1f} img/s | "
          f"VAE encode (image+flip) {encode_rate:.2f} img/s | end-to-end {total_rate:.2f} img/s", flush=True)


def build_containers(folder: Path, work: Path, per_tar: int = 1000) -> dict[str, Path]:
    """The images of `folder`, in its listing order, as an HF dataset, parquet files and tars."""
    import io
    import tarfile

    import datasets

    listing = list_image_folder(folder, require_classes=True)
    rows = [((folder / f).read_bytes(), f, y) for f, y in zip(listing.files, listing.labels)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=listing.class_names)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": f} for b, f, _ in rows],
                                     "label": [y for _, _, y in rows]}, features=features)
    out = {"imagefolder": folder, "hf": work / "hf", "parquet": work / "parquet", "wds": work / "wds"}
    ds.save_to_disk(str(out["hf"]))
    out["parquet"].mkdir()
    ds.to_parquet(str(out["parquet"] / "train-00000.parquet"))
    out["wds"].mkdir()
    for t in range(0, len(rows), per_tar):
        with tarfile.open(out["wds"] / f"train-{t // per_tar:04d}.tar", "w") as tar:
            for i, (data, _, y) in enumerate(rows[t:t + per_tar], start=t):
                for name, payload in ((f"{i:08d}.jpg", data), (f"{i:08d}.cls", str(y).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return out


def bench_containers(names: list[str], n: int, image_size: int, args: argparse.Namespace, work: Path) -> None:
    from diffusers import AutoencoderKL

    data = work / f"images-{n}"
    if not data.exists():
        make_images(data, n)
    containers = build_containers(data, work / "containers")
    vae_dir = work / "vae-tiny"
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, **ARCHS["tiny"]).save_pretrained(vae_dir)
    reference = None
    for name in names:
        t0 = time.perf_counter()
        source = open_source(str(containers[name]))
        list_s = time.perf_counter() - t0
        images = source.images(image_size, 8)
        t0 = time.perf_counter()
        for i in range(len(images)):
            images[i]
        decode_rate = n / (time.perf_counter() - t0)
        out = work / f"latents-{name}"
        cfg = ExtractConfig(data_path=str(containers[name]), vae=str(vae_dir), out=str(out), image_size=image_size,
                            shard_size=args.shard_size, batch_size=args.batch_size, num_workers=args.num_workers)
        t0 = time.perf_counter()
        run_extraction(cfg, DistContext(device=torch.device(args.device)))
        total_rate = n / (time.perf_counter() - t0)
        from safetensors.torch import load_file
        shards = [load_file(p) for p in sorted(out.glob("shard-*.safetensors"))]
        reference = reference or shards
        same = all(torch.equal(a[k], b[k]) for a, b in zip(shards, reference) for k in ("mean", "std", "label"))
        print(f"RESULT container={name} images={n} image_size={image_size} batch={args.batch_size} "
              f"workers={args.num_workers} threads={torch.get_num_threads()} | listing {list_s:.2f} s | "
              f"decode+crop {decode_rate:.1f} img/s | end-to-end (tiny VAE) {total_rate:.2f} img/s | "
              f"latents bitwise equal to {names[0]}'s: {same}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="tiny,sd-vae", help="comma-separated: tiny, sd-vae")
    p.add_argument("--tiny-images", type=int, default=64)
    p.add_argument("--sd-images", type=int, default=4, help="few on CPU: the SD-VAE encoder is slow there")
    p.add_argument("--tiny-size", type=int, default=32,
                   help="crop size for the tiny VAE (its mid-block attention runs at size/2, so keep it small)")
    p.add_argument("--sd-size", type=int, default=256, help="crop size for the SD-VAE (256 or 512)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=5000)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vae-dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--containers", help="comma-separated imagefolder,hf,parquet,wds: time each container instead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_extract_") as tmp:
        if args.containers:
            bench_containers(args.containers.split(","), args.tiny_images, args.tiny_size, args, Path(tmp))
            return 0
        for arch in args.archs.split(","):
            tiny = arch == "tiny"
            bench(arch, args.tiny_images if tiny else args.sd_images, args.tiny_size if tiny else args.sd_size,
                  args, Path(tmp))
    return 0


if __name__ == "__main__":
    run_cli(main)
