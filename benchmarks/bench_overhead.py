#!/usr/bin/env python3
"""Overhead of the residual topologies: one training step (forward + backward + AdamW) and memory,
against the cascaded DiT, at the DiT-S/2 and DiT-B/2 shapes (32x32x4 latents, patch 2: 256 tokens).

All topologies of one shape share the same backbone modules (embedders, blocks, final layer) and
one AdamW over the union of their parameters: AdamW skips parameters without a gradient, so each
timed step updates exactly that model's parameters, while the backbone is held in memory once.
Runs are interleaved: every round visits every topology (in a rotated order) for a few steps; the
reported time is the median over rounds of the mean step time in a round.

Memory: on CUDA, torch.cuda.max_memory_allocated during a step (weights, gradients, AdamW state
and activations); on CPU, the bytes of the tensors autograd saves for backward in one eager
forward (activations; parameters excluded, storages counted once), via saved_tensors_hooks.

    python -m benchmarks.bench_overhead                                    # CPU, fp32, eager
    python -m benchmarks.bench_overhead --device cuda --dtype bf16 --compile --batch-size 32
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import TOPOLOGIES, create_model
from benchmarks.profiling import saved_activation_bytes

DEFAULT_TOPOLOGIES = ("cascaded", "ancre", "denseformer", "hc", "hc-dynamic", "mhc")
SHARED = ("x_embedder", "t_embedder", "y_embedder", "blocks", "final_layer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["DiT-S/2", "DiT-B/2"])
    p.add_argument("--topologies", nargs="+", default=list(DEFAULT_TOPOLOGIES))
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256x256 images)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=2, help="timed steps per topology per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per topology before the rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype (fp32 = no autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--tau", type=float, default=0.01)
    p.add_argument("--hc-streams", type=int, default=4)
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    unknown = [t for t in args.topologies if t not in TOPOLOGIES]
    if unknown:
        raise UserError(f"unknown topology {unknown[0]!r}; choose from {', '.join(TOPOLOGIES)}")
    if "cascaded" not in args.topologies:
        args.topologies.insert(0, "cascaded")  # the reference of every ratio
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda given but no CUDA device is visible; run on a GPU machine or use --device cpu")
    if min(args.rounds, args.steps, args.batch_size) < 1:
        raise UserError("--rounds, --steps and --batch-size must be at least 1")
    return args


def build_models(name: str, args) -> tuple[dict[str, torch.nn.Module], dict[str, int]]:
    """One model per topology, all sharing the cascaded model's backbone modules."""
    kwargs = dict(input_size=args.input_size, in_channels=4, num_classes=1000, learn_sigma=True,
                  tau=args.tau, hc_streams=args.hc_streams, sinkhorn_iters=args.sinkhorn_iters)
    torch.manual_seed(args.seed)
    base = create_model(name, topology="cascaded", **kwargs).to(args.device)
    models, added = {}, {}
    for topology in args.topologies:
        model = base if topology == "cascaded" else create_model(name, topology=topology, **kwargs)
        for attr in SHARED:
            setattr(model, attr, getattr(base, attr))
        model.pos_embed = base.pos_embed
        models[topology] = model.to(args.device).train()
        added[topology] = sum(p.numel() for p in model.topology.parameters())
    return models, added


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    memory_kind = ("peak torch.cuda.max_memory_allocated during a step (weights+grads+AdamW+activations)" if cuda
                   else "autograd saved tensors of one eager forward (activations, parameters excluded)")
    print(f"# bench_overhead  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  "
          f"torch {torch.__version__}  {platform.processor() or platform.machine()}  threads {torch.get_num_threads()}")
    print(f"# device {device}{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}  dtype {args.dtype}  "
          f"compile {args.compile}  batch {args.batch_size}  tokens {(args.input_size // 2) ** 2}  "
          f"rounds {args.rounds} x {args.steps} steps (median of round means), warmup {args.warmup}")
    print(f"# memory: {memory_kind}")
    for name in args.models:
        models, added = build_models(name, args)
        unique = {id(p): p for m in models.values() for p in m.parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW(unique.values(), lr=1e-4, weight_decay=0.0)
        runners = {t: (torch.compile(m) if args.compile else m) for t, m in models.items()}
        g = torch.Generator().manual_seed(args.seed)
        batch = (torch.randn(args.batch_size, 4, args.input_size, args.input_size, generator=g).to(device),
                 torch.randint(0, 1000, (args.batch_size,), generator=g).to(device),
                 torch.randint(0, 1000, (args.batch_size,), generator=g).to(device))

        def step(topology):
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                out = runners[topology](*batch)
            out.float().square().mean().backward()
            optimizer.step()

        memory = {}
        for topology in tqdm(args.topologies, desc=f"{name} warmup", leave=False):
            if not cuda:
                memory[topology] = saved_activation_bytes(models[topology], batch, autocast)
            for _ in range(args.warmup):
                step(topology)
            if cuda:
                sync()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.reset_peak_memory_stats(device)
                step(topology)
                sync()
                memory[topology] = torch.cuda.max_memory_allocated(device)
        times = {t: [] for t in args.topologies}
        for r in tqdm(range(args.rounds), desc=f"{name} rounds", leave=False):
            k = r % len(args.topologies)
            for topology in args.topologies[k:] + args.topologies[:k]:
                sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(topology)
                sync()
                times[topology].append((time.perf_counter() - start) / args.steps)
        ref_time, ref_mem = statistics.median(times["cascaded"]), memory["cascaded"]
        print(f"\n{name}  (backbone {sum(p.numel() for n, p in models['cascaded'].named_parameters()):,} parameters)")
        print(f"{'topology':<13}{'params added':>14}{'step ms':>10}{'time ratio':>12}{'min..max ms':>17}"
              f"{'memory MiB':>12}{'mem ratio':>11}")
        for topology in args.topologies:
            med = statistics.median(times[topology])
            spread = f"{min(times[topology]) * 1e3:.0f}..{max(times[topology]) * 1e3:.0f}"
            print(f"{topology:<13}{added[topology]:>14,}{med * 1e3:>10.1f}{med / ref_time:>12.3f}{spread:>17}"
                  f"{memory[topology] / 2**20:>12.1f}{memory[topology] / ref_mem:>11.3f}")
        del models, runners, optimizer, unique
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    run_cli(main)
