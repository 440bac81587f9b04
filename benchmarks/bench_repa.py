#!/usr/bin/env python3
"""Cost of REPA: one training step (forward + backward + AdamW; --mode fwd+bwd leaves out the AdamW
step) with the alignment loss against the same step without it, at the DiT-B/2 shape (32x32x4
latents, 256 tokens) by default.

REPA adds the frozen encoder's forward on the clean images (no backward), the projector's forward
and backward, and the loss; the DiT's own forward and backward are the same. The encoder is a
random-weight ViT of the named timm architecture (DINOv2 ViT-B/14 by default) at the resolution
that matches the DiT's token grid (16 x 14 = 224 px): its cost does not depend on its weights.

Each round also times the frozen encoder's forward alone, printed as its share of the REPA step.

Rounds are paired: every round times both variants (in alternating order) for a few steps, and the
reported ratio is the median of the per-round ratios with its distribution-free 95% interval
(ancre_dit.evaluation.stats.paired_ratio), which cancels a shared machine's slow drifts.

    python -m benchmarks.bench_repa                        # CPU, fp32, DiT-B/2 + ViT-B/14, batch 2
    python -m benchmarks.bench_repa --device cuda --dtype bf16 --batch-size 32
    python -m benchmarks.bench_repa --smoke                # a tiny model and encoder: seconds
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.evaluation.stats import paired_ratio
from ancre_dit.models import create_model
from ancre_dit.training.config_sections import RepaConfig
from ancre_dit.training.repa import FrozenEncoder, StateTap, alignment_loss, build_encoder, make_projector

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMOKE = dict(model="DiT-T/2", model_kwargs=dict(depth=2, hidden_size=32, num_heads=2), input_size=8, image_size=32,
             encoder="vit_tiny_patch16_224", encoder_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2),
             depth=1, projector_dim=16, rounds=2, steps=1, warmup=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="DiT-B/2")
    p.add_argument("--topology", default="cascaded")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256x256 images)")
    p.add_argument("--image-size", type=int, default=256, help="side of the clean images the encoder sees")
    p.add_argument("--encoder", default="vit_base_patch14_dinov2.lvd142m", help="timm name (random weights)")
    p.add_argument("--depth", type=int, default=8, help="the block whose output is aligned")
    p.add_argument("--projector-dim", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=6, help="paired rounds; the median ratio is reported")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before the rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype (fp32 = no autocast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("train", "fwd+bwd"), default="train",
                   help="train = forward + backward + AdamW step; fwd+bwd = without the optimizer step")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu = this process's CPU time (with --threads 1 on a shared machine, other processes do "
                        "not enter the time); CPU device only")
    p.add_argument("--smoke", action="store_true", help="a tiny DiT and encoder, 2 rounds: checks the harness in seconds")
    args = p.parse_args(argv)
    args.model_kwargs, args.encoder_kwargs = {}, {}
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda given but no CUDA device is visible; run on a GPU machine or use --device cpu")
    if args.clock == "cpu" and args.device != "cpu":
        raise UserError("--clock cpu measures this process's CPU time; use it with --device cpu")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    if min(args.rounds, args.steps, args.batch_size) < 1:
        raise UserError("--rounds, --steps and --batch-size must be at least 1")
    return args


def build(args) -> tuple[torch.nn.Module, FrozenEncoder, torch.nn.Module, StateTap]:
    """The DiT, a random-weight encoder whose patch grid is the DiT's token grid, the projector, the tap."""
    torch.manual_seed(args.seed)
    model = create_model(args.model, topology=args.topology, input_size=args.input_size, in_channels=4,
                         num_classes=1000, **args.model_kwargs).to(args.device).train()
    grid = args.input_size // model.patch_size
    if not 1 <= args.depth <= len(model.blocks):
        raise UserError(f"--depth {args.depth} is outside the model's 1..{len(model.blocks)} blocks")
    cfg = RepaConfig(encoder=args.encoder, encoder_kwargs=args.encoder_kwargs)
    frozen = build_encoder(cfg, grid, args.device, bf16=args.dtype == "bf16", load_weights=False)
    projector = make_projector(model.pos_embed.shape[-1], args.projector_dim, frozen.dim).to(args.device)
    return model, frozen, projector, StateTap(args.depth)


def main(argv: list[str] | None = None) -> None:
    measure(parse_args(argv))


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Times both variants in paired rounds, prints the table; returns the medians and the ratio."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = DTYPES[args.dtype]
    model, encoder, projector, tap = build(args)
    params = list(model.parameters()) + list(projector.parameters())
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    n, s = args.batch_size, args.input_size
    x = torch.randn(n, 4, s, s, generator=g).to(device)
    t = torch.randint(0, 1000, (n,), generator=g).to(device)
    y = torch.randint(0, 1000, (n,), generator=g).to(device)
    images = torch.randint(0, 256, (n, 3, args.image_size, args.image_size), generator=g, dtype=torch.uint8).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step(repa: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if repa:
                with tap.attached(model.topology):
                    out = model(x, t, y)
                loss = out.float().square().mean() + 0.5 * alignment_loss(projector(tap.take()), encoder(images))
            else:
                out = model(x, t, y)
                loss = out.float().square().mean()
        loss.backward()
        if args.mode == "train":
            optimizer.step()

    print(f"# bench_repa  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"{platform.processor() or platform.machine()}  threads {torch.get_num_threads()}  mode {args.mode}  "
          f"clock {args.clock}")
    print(f"# device {device}  dtype {args.dtype}  {args.model} ({args.topology}), batch {n}, {(s // model.patch_size) ** 2} "
          f"tokens; encoder {args.encoder} (random weights) at {encoder.resolution} px, depth {args.depth}, "
          f"projector {args.projector_dim}; {args.rounds} paired rounds x {args.steps} steps, warmup {args.warmup}")
    for repa in (False, True):
        for _ in range(args.warmup):
            step(repa)

    def encode() -> None:  # the frozen encoder alone, as the REPA step runs it
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            encoder(images)

    times: dict[bool, list[float]] = {False: [], True: []}
    encoder_times: list[float] = []
    for r in range(args.rounds):
        for repa in ((False, True) if r % 2 == 0 else (True, False)):
            sync()
            start = clock()
            for _ in range(args.steps):
                step(repa)
            sync()
            times[repa].append((clock() - start) / args.steps)
        start = clock()
        for _ in range(args.steps):
            encode()
        sync()
        encoder_times.append((clock() - start) / args.steps)
    ratio = paired_ratio(times[True], times[False])
    share = paired_ratio(encoder_times, times[True])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    interval = f", 95% interval {ratio.interval[0]:.3f}..{ratio.interval[1]:.3f}" if ratio.interval else ""
    print(f"step without REPA {off * 1e3:.1f} ms, with REPA {on * 1e3:.1f} ms (medians); "
          f"with / without: {ratio.median:.3f} (median of {ratio.rounds} paired rounds{interval})")
    print(f"frozen encoder forward alone {statistics.median(encoder_times) * 1e3:.1f} ms: {share.median:.1%} of the "
          f"step with REPA (median of the per-round shares)")
    return {"off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": ratio.median, "encoder_share": share.median}


if __name__ == "__main__":
    run_cli(main)
