#!/usr/bin/env python3
"""ANCRe's aggregation cost and a peer (diffusers' DiT) side by side, on the same DiT shapes.

Variants, all at the same DiT shape (32x32x4 latents, 1000 classes, learn_sigma):

    cascaded      our plain DiT
    ancre         ANCRe, eager aggregation = the fused weighted sum (topologies/aggregation.py)
    ancre-chain   ANCRe with the plain addcmul chain (what the compiler sees)
    diffusers     diffusers' DiTTransformer2DModel with the same depth / width / heads / patch
    cascaded+gc, ancre+gc   with activation checkpointing per block (--checkpointing)
    TOPOLOGY:key=value,...  any registered topology with its options and the backbone's:
                  dar:query=static,chunk=4   attnres:block=3
                  cascaded:norm=rmsnorm,mlp=swiglu,pos_embed=rope2d,qk_norm=true (the LightningDiT block)

Modes, each timed separately:

    fwd+bwd       forward + backward of a squared-output loss, no optimizer step
    train         the same plus AdamW's step (the step the trainer takes)
    sample        one no-grad forward in eval mode (a sampling step without guidance)

Every model starts from its own initialisation with its all-zero parameter tensors (our adaLN-Zero
and output layers, zero biases) set to small random values, as after some training: at
initialisation those layers make every upstream gradient exactly zero, and AdamW's CPU step runs
about twice as slow on all-zero gradients (measured on a 2304x384 tensor: 7.7 ms against 3.7 ms
with random ones), which would charge our model for its initialisation, not for its code.

Every round runs every (variant, mode) in a rotated order; the median over rounds of the mean
step time is reported, and ratios are taken between medians of the same run ("x cascaded") and,
less sensitive to a shared machine's drifts, as the median of the per-round ratios ("paired",
with its quartiles and the median's distribution-free 95% interval: ancre_dit.evaluation.stats).
`--share N` also profiles N eager ANCRe steps and prints the share of the step spent in the
aggregation (benchmarks.profiling.aggregation_share), an estimate of ANCRe / cascaded - 1 taken
within the same steps. Memory: bytes of the tensors autograd saves in one forward (activations;
parameters excluded), as benchmarks/bench_overhead.py counts them on the CPU.

    python -m benchmarks.bench_peer --models DiT-S/2 DiT-B/2 --batch-sizes 4 2 --threads 2
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.evaluation.stats import paired_ratio as paired_stats
from ancre_dit.models import TOPOLOGIES, create_model
from ancre_dit.models.dit import DIT_MODELS, DIT_SIZES
from ancre_dit.models.layers import DEFAULTS, MLPS, NORMS, POS_EMBEDS, check_choice
from ancre_dit.models.topologies import resolve_options
from benchmarks.profiling import aggregation_share, saved_activation_bytes

MODES = ("fwd+bwd", "train", "sample")
VARIANTS = ("cascaded", "ancre", "ancre-chain", "diffusers")  # the defaults; any TOPOLOGY[:key=value,...] works too


def topology_variant(variant: str) -> tuple[str, dict]:
    """"dar:query=static,chunk=4" -> ("dar", {"query": "static", "chunk": 4}); "+gc" and "-chain" stripped."""
    import yaml

    name, _, options = variant.split("+")[0].replace("-chain", "").partition(":")
    if name not in TOPOLOGIES:
        raise UserError(f"unknown variant {variant!r}; give diffusers, ancre-chain or a topology "
                        f"({', '.join(TOPOLOGIES)}) with options as name:key=value,key=value")
    pairs = [item.partition("=") for item in options.split(",") if item]
    if any(not sep for _, sep, _ in pairs):
        raise UserError(f"variant {variant!r}: give options as key=value, e.g. dar:query=static,chunk=4")
    return name, {key: yaml.safe_load(value) for key, _, value in pairs}


def check_variant(variant: str) -> None:
    """Unknown topologies, options and values as one line now, not when the model is built mid-run."""
    name, options = topology_variant(variant)
    backbone = {key: options.pop(key) for key in list(options) if key in DEFAULTS}
    resolve_options(name, options)
    for key, choices in (("norm", NORMS), ("mlp", MLPS), ("pos_embed", POS_EMBEDS)):
        if key in backbone:
            check_choice(key, backbone[key], choices)


def build(variant: str, name: str, input_size: int, compile_: bool) -> torch.nn.Module:
    size, patch = DIT_MODELS[name]
    depth, hidden, heads = DIT_SIZES[size]
    if variant == "diffusers":
        from diffusers import DiTTransformer2DModel
        model = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=hidden // heads, in_channels=4,
                                      out_channels=8, num_layers=depth, sample_size=input_size, patch_size=patch,
                                      num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
        forward = model.forward
        model.forward = lambda x, t, y: forward(x, timestep=t, class_labels=y, return_dict=False)[0]
    else:
        topology, options = topology_variant(variant)
        model = create_model(name, topology=topology, input_size=input_size, in_channels=4, num_classes=1000,
                             **options)
        if variant.startswith("ancre-chain"):
            model.topology.use_chain = True
        model.set_grad_checkpointing(variant.endswith("+gc"))
    leave_zero_init(model)
    return torch.compile(model) if compile_ else model


def leave_zero_init(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Gives every all-zero trainable tensor N(0, std^2) values (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * std)


def paired_ratio(times: list[float], reference: list[float]) -> str:
    """Median and quartiles of the per-round ratios, as printed."""
    stats = paired_stats(times, reference)
    if stats.quartiles is None:
        return f"{stats.median:.3f}"
    return f"{stats.median:.3f} [{stats.quartiles[0]:.3f}..{stats.quartiles[1]:.3f}]"


def paired_interval(times: list[float], reference: list[float]) -> str:
    """95% interval of the median per-round ratio, as printed ("" with too few rounds to have one)."""
    interval = paired_stats(times, reference).interval
    return "" if interval is None else f"{interval[0]:.3f}..{interval[1]:.3f}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["DiT-S/2"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help="cascaded, ancre, ancre-chain (the addcmul chain), diffusers, or any registered topology "
                        "with topology and backbone options: mhc, dar:query=static,chunk=4, attnres:block=3, "
                        "cascaded:norm=rmsnorm,mlp=swiglu,pos_embed=rope2d,qk_norm=true")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--checkpointing", action="store_true", help="add cascaded+gc and ancre+gc")
    p.add_argument("--compile", action="store_true", help="torch.compile every variant (inductor)")
    p.add_argument("--share", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS eager ancre fwd+bwd steps: the aggregation's share of the step")
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per (variant, mode) per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu = this process's CPU time (use with --threads 1 on a shared machine: other "
                        "processes then do not enter the time)")
    args = p.parse_args(argv)
    bad = [m for m in args.models if m not in DIT_MODELS]
    if bad:
        raise UserError(f"unknown model {bad[0]!r}; choose from {', '.join(DIT_MODELS)}")
    for variant in args.variants:
        if variant not in ("diffusers",):
            check_variant(variant)
    if "cascaded" not in args.variants:
        args.variants.insert(0, "cascaded")
    if args.checkpointing:
        args.variants += ["cascaded+gc", "ancre+gc"]
    if min(args.rounds, args.steps, *args.batch_sizes) < 1:
        raise UserError("--rounds, --steps and --batch-sizes must be at least 1")
    return args


def measure(args) -> dict:
    """Runs every (model, batch): returns {(model, batch): {(variant, mode): median seconds}, memory}."""
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"# bench_peer  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"{platform.machine()}  threads {torch.get_num_threads()}  load average {os.getloadavg()[0]:.2f}  "
          f"compile {args.compile}  fp32  clock {args.clock}  rounds {args.rounds} x {args.steps} steps (median of round means)")
    results = {}
    for name in args.models:
        for batch_size in args.batch_sizes:
            torch.manual_seed(0)
            models = {v: build(v, name, args.input_size, args.compile).train() for v in args.variants}
            optimizers = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
            g = torch.Generator().manual_seed(0)
            batch = (torch.randn(batch_size, 4, args.input_size, args.input_size, generator=g),
                     torch.randint(0, 1000, (batch_size,), generator=g), torch.randint(0, 1000, (batch_size,), generator=g))

            def step(variant, mode):
                model = models[variant]
                if mode == "sample":
                    model.eval()
                    with torch.no_grad():
                        model(*batch)
                    model.train()
                    return
                optimizers[variant].zero_grad(set_to_none=True)
                model(*batch).square().mean().backward()
                if mode == "train":
                    optimizers[variant].step()

            memory = {v: saved_activation_bytes(m, batch) for v, m in models.items()} if not args.compile else {}
            configs = [(v, m) for v in args.variants for m in args.modes]
            for config in configs:
                for _ in range(args.warmup):
                    step(*config)
            times = {c: [] for c in configs}
            for r in range(args.rounds):
                k = (r * 5) % len(configs)
                for config in configs[k:] + configs[:k]:
                    start = clock()
                    for _ in range(args.steps):
                        step(*config)
                    times[config].append((clock() - start) / args.steps)
            med = {c: statistics.median(v) for c, v in times.items()}
            results[(name, batch_size)] = {"time": med, "memory": memory, "spread": times}
            print(f"\n{name} batch {batch_size}  (load average now {os.getloadavg()[0]:.2f})")
            w = max(14, 2 + max(map(len, args.variants)))
            print(f"{'variant':<{w}}{'mode':<10}{'ms':>10}{'x cascaded':>12}{'paired [IQR]':>22}{'min..max ms':>16}"
                  f"{'median 95% CI':>16}{'saved MiB':>11}")
            for v, m in configs:
                ratio = med[(v, m)] / med[("cascaded", m)]
                spread = f"{min(times[(v, m)]) * 1e3:.0f}..{max(times[(v, m)]) * 1e3:.0f}"
                mem = f"{memory[v] / 2**20:.1f}" if v in memory and m == args.modes[0] else ""
                print(f"{v:<{w}}{m:<10}{med[(v, m)] * 1e3:>10.1f}{ratio:>12.3f}"
                      f"{paired_ratio(times[(v, m)], times[('cascaded', m)]):>22}{spread:>16}"
                      f"{paired_interval(times[(v, m)], times[('cascaded', m)]):>16}{mem:>11}")
            if args.share and "ancre" in models and not args.compile:
                seconds, step_seconds = aggregation_share(models["ancre"], batch, args.share)
                print(f"ancre aggregation (profiled, {args.share} fwd+bwd steps): {seconds * 1e3:.1f} ms of "
                      f"{step_seconds * 1e3:.1f} ms per step = {seconds / step_seconds:.2%}")
            if "diffusers" in args.variants:
                parts = []
                for m in args.modes:
                    ours, theirs = times[("cascaded", m)], times[("diffusers", m)]
                    interval = paired_interval(ours, theirs)
                    parts.append(f"{m} {med[('cascaded', m)] / med[('diffusers', m)]:.3f} (paired "
                                 f"{paired_ratio(ours, theirs)}{'; 95% ' + interval if interval else ''})")
                print(f"cascaded / diffusers: {', '.join(parts)}")
            del models, optimizers
    return results


def main(argv=None) -> None:
    measure(parse_args(argv))


if __name__ == "__main__":
    run_cli(main)
