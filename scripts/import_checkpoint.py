#!/usr/bin/env python3
"""Imports a published .pt checkpoint (DiT, official ANCRe, SiT, REPA, LightningDiT) as a checkpoint folder.

    python scripts/import_checkpoint.py DiT-XL-2-256x256.pt --model DiT-XL/2 --image-size 256 --out ckpts/dit-xl2
    python scripts/import_checkpoint.py 0400000.pt --out ckpts/ancre-b2         # architecture from the file's args
    python scripts/import_checkpoint.py SiT-XL-2-256x256.pt --source sit --model SiT-XL/2 --out ckpts/sit-xl2
    python scripts/import_checkpoint.py repa-0400000.pt --out ckpts/repa-xl2    # REPA: recognised by its projectors
    python scripts/import_checkpoint.py lightningdit-xl-imagenet256-800ep.pt --model LightningDiT-XL/1 \
        --latent-stats latents_stats.pt --out ckpts/lightningdit-xl1
    python sample.py --ckpt ckpts/dit-xl2 --vae VAE_DIR --protocol dit --cfg-scale 1.5 --num-samples 50000 --out s.npz

The folder (model_spec.json + safetensors) is read by sample.py and evaluate.py like any other.
The file is loaded with torch.load(weights_only=True): a file that wants to run code is refused.
"""
from __future__ import annotations

from pathlib import Path

from ancre_dit.checkpoint import SPEC_FILE, import_checkpoint
from ancre_dit.checkpoint.importing import SOURCES
from ancre_dit.cli import CommandParser, output_folder, run_cli
from ancre_dit.models import TOPOLOGIES


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="the .pt file: a bare state dict or a {model, ema, opt, args} checkpoint")
    p.add_argument("--source", choices=SOURCES, default=None,
                   help="who trained the file (default: recognised: REPA by its projectors, LightningDiT by its block, "
                        "ANCRe by its logits, SiT by its transport args, else DiT; SiT's bare release state dict "
                        "needs --source sit)")
    p.add_argument("--model", default=None, help="e.g. DiT-XL/2 or SiT-XL/2 (default: the file's args.model)")
    p.add_argument("--image-size", type=int, default=None, help="pixels (default: the file's args.image_size, else 256)")
    p.add_argument("--topology", choices=list(TOPOLOGIES), default=None,
                   help="default: ancre if the file has ANCRe logits (ancre-outgoing for the per-source layout), "
                        "else cascaded")
    p.add_argument("--latent-stats", type=Path, default=None,
                   help="LightningDiT: its latents_stats.pt (per-channel mean and std of the VA-VAE latents), so "
                        "samples decode in the VAE's space")
    p.add_argument("--tau", type=float, default=None, help="ANCRe temperature if the file does not store it (0.01)")
    p.add_argument("--weights", choices=("ema", "model"), default=None,
                   help="which weights of a training checkpoint to import (default: ema when present)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint folder an earlier import wrote")
    a = p.parse_args(argv)
    output_folder(a.out, "checkpoint folder", SPEC_FILE, replace_own=False, overwrite=a.overwrite)
    spec = import_checkpoint(a.src, a.out, model=a.model, image_size=a.image_size, topology=a.topology, tau=a.tau,
                             weights=a.weights, source=a.source, latent_stats=a.latent_stats,
                             overwrite=a.overwrite)
    kw = spec["model"]["kwargs"]
    source = spec["imported"]["from"]
    print(f"imported {source}'s {spec['model']['name']} ({kw['topology']}, {spec['imported']['weights']} weights, "
          f"{spec['data']['image_size']} px, {kw['num_classes']} classes, {spec['diffusion']['objective']} "
          f"objective) to {a.out}")
    protocol = "dit" if source == "ancre" else source
    print(f"sample it with: python sample.py --ckpt {a.out} --vae VAE_DIR --protocol {protocol} --out samples.npz")
    return 0


if __name__ == "__main__":
    run_cli(main)
