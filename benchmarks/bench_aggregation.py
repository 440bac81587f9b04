#!/usr/bin/env python3
"""ANCRe's aggregation alone: the trunk of K blocks with the blocks reduced to a scalar multiply,
so nearly all of the time is the weighted history sums, forward + backward.

Forms, all of one `ANCReTopology` (same logits, same inputs), interleaved round by round:

    chain      the plain addcmul chain (what torch.compile sees; autograd's backward)
    stacked    the history in one store, one product per node forward and per source backward, the
               weights' gradient one Gram product (the eager default; aggregation.py, `StackedPlan`)
    compiled   (--compile) the chain under torch.compile (inductor), which fuses it itself
    none       (--block linear) the blocks alone, no skip sums (and none-compiled with --compile)

A whole-model ratio moves by +-7% between rounds on a 2-core machine with other load; this trunk runs in tens
of milliseconds, so the forms can be told apart to a few percent. Minor page faults per step are
counted too: on Linux every fresh multi-MiB tensor is new memory from the kernel.

    python -m benchmarks.bench_aggregation                          # DiT-S/2 shape, batch 4
    python -m benchmarks.bench_aggregation --depth 12 --tokens 256 --width 768 --batch-size 2   # DiT-B/2
    python -m benchmarks.bench_aggregation --compile
    python -m benchmarks.bench_aggregation --compile --block linear      # graphs split at every block

--traffic prints, instead of timing anything, the bytes the aggregation moves per training step of a
model (benchmarks/traffic.py: the eager stacked form with the torch ops and with its Triton kernels,
and the floor, fp32 and bf16 history), and with
--gpu the time that takes at the GPU's bandwidth and, given --cascaded-ms, the floor ratio:

    python -m benchmarks.bench_aggregation --traffic --model DiT-B/2 --batch-size 256 --gpu H200 --cascaded-ms 83.03
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import statistics
import time
from datetime import datetime, timezone

import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import DIT_MODELS
from ancre_dit.models.dit import DIT_SIZES
from ancre_dit.models.topologies import CascadedTopology
from ancre_dit.models.topologies.ancre import ANCReTopology
from benchmarks import traffic
from benchmarks.traffic import BANDWIDTH_TBS

FORMS = ("chain", "stacked")


class ScaleBlock(torch.nn.Module):
    """A stand-in block: one learnable scalar, so the trunk's time is the aggregation's."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, h: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        return h * self.scale


class LinearBlock(torch.nn.Module):
    """A stand-in block with a matrix multiply, which torch.compile cannot fuse across: the compiled
    trunk then splits at every block, as in the real model."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        return self.linear(h)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=3, help="timed steps per form per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time the chain compiled with torch.compile")
    p.add_argument("--block", choices=("scale", "linear"), default="scale",
                   help="stand-in block: a scalar multiply, or a width x width linear map (splits compiled graphs); "
                        "'linear' also times the blocks alone ('none', no skip sums)")
    p.add_argument("--traffic", action="store_true", help="print the bytes the aggregation moves per step; time nothing")
    p.add_argument("--model", default="DiT-B/2", help="--traffic: the model (DiT-S/2, DiT-B/2, DiT-XL/2, ...)")
    p.add_argument("--image-size", type=int, default=256, help="--traffic: pixels (latents are 8x smaller)")
    p.add_argument("--topk", type=int, default=2, help="--traffic: also count sparse ANCRe keeping this many edges")
    p.add_argument("--gpu", choices=sorted(BANDWIDTH_TBS), help="--traffic: the time those bytes take at its bandwidth")
    p.add_argument("--cascaded-ms", type=float, help="--traffic: the plain DiT's step time there, for the floor ratio")
    args = p.parse_args(argv)
    if args.traffic:
        if args.model not in DIT_MODELS:
            raise UserError(f"unknown model {args.model!r}; choose one of {', '.join(DIT_MODELS)}")
        if args.cascaded_ms is not None and (args.gpu is None or args.cascaded_ms <= 0):
            raise UserError("--cascaded-ms needs --gpu and a positive step time")
    if min(args.depth, args.batch_size, args.tokens, args.width, args.rounds, args.steps) < 1:
        raise UserError("--depth, --batch-size, --tokens, --width, --rounds and --steps must be at least 1")
    return args


def make_topology(form: str, depth: int) -> ANCReTopology:
    """`form`'s topology (the compiled form is the chain; `measure` compiles it)."""
    topology = ANCReTopology(depth)
    with torch.no_grad():  # off the uniform init, the same logits for every form
        g = torch.Generator().manual_seed(0)
        for logits in topology.logits:
            logits.copy_(0.01 * torch.randn(logits.shape, generator=g))
    topology.use_chain = form == "chain"
    return topology


def edge_read_ms(edges: int, shape: tuple[int, ...], repeats: int = 10) -> tuple[float, float]:
    """(ms, GB/s) of one streaming read of `edges` activations of `shape`, timed as a matrix-vector
    product over them stacked (fastest of `repeats`). Any aggregation reads each edge's source at
    least once forward and each reader's gradient at least once backward, so twice this is about
    the least its fwd+bwd can cost from memory (less where the tensors still sit in the cache)."""
    stacked = torch.randn(edges, math.prod(shape))
    weights = torch.randn(edges)
    torch.mv(stacked.t(), weights)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(stacked.t(), weights)
        best = min(best, time.perf_counter() - start)
    return best * 1e3, stacked.numel() * stacked.element_size() / best / 1e9


def measure(args) -> dict[str, list[float]]:
    torch.set_num_threads(args.threads)
    print(f"# bench_aggregation  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"{platform.machine()}  threads {torch.get_num_threads()}  load average {os.getloadavg()[0]:.2f}  fp32  "
          f"depth {args.depth}  activation {args.batch_size}x{args.tokens}x{args.width}  "
          f"rounds {args.rounds} x {args.steps} steps")
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(ScaleBlock() if args.block == "scale" else LinearBlock(args.width)
                                 for _ in range(args.depth))
    h0 = torch.randn(args.batch_size, args.tokens, args.width, generator=torch.Generator().manual_seed(1),
                     requires_grad=True)
    forms = FORMS + ("compiled",) * args.compile
    topologies = {form: make_topology(form, args.depth) for form in forms}
    modules = {form: torch.compile(t) if form == "compiled" else t for form, t in topologies.items()}
    if args.block == "linear":  # the blocks alone, eager and compiled: what the forms add to them
        forms += ("none",) + ("none-compiled",) * args.compile
        for form in forms[-1 - args.compile:]:
            modules[form] = CascadedTopology(args.depth)
            if form == "none-compiled":
                modules[form] = torch.compile(modules[form])

    def step(form: str) -> None:
        modules[form].zero_grad(set_to_none=True)
        modules[form](h0, blocks, None).sum().backward()

    for form in forms:  # warm up (compile), and check the forms agree
        step(form)
        step(form)
    grads = {form: torch.cat([p.grad for p in topologies[form].logits[1:]]) for form in topologies}
    scale = grads["chain"].abs().max().item()  # (logit gradients are sums over the whole activation: relative tolerance)
    for form in list(topologies)[1:]:
        torch.testing.assert_close(grads[form], grads["chain"], rtol=1e-3, atol=1e-4 * scale)
    times = {form: [] for form in forms}
    faults = {form: 0 for form in forms}
    for r in range(args.rounds):
        order = forms[r % len(forms):] + forms[:r % len(forms)]
        for form in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            for _ in range(args.steps):
                step(form)
            times[form].append((time.perf_counter() - start) / args.steps)
            faults[form] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    edges = args.depth * (args.depth + 1) // 2
    print(f"\n{'form':<8}{'ms/step':>10}{'x chain':>10}{'min..max ms':>16}{'faults/step':>13}   ({edges} edges, fwd+bwd)")
    chain = statistics.median(times["chain"])
    for form in forms:
        med = statistics.median(times[form])
        spread = f"{min(times[form]) * 1e3:.1f}..{max(times[form]) * 1e3:.1f}"
        print(f"{form:<8}{med * 1e3:>10.2f}{med / chain:>10.3f}{spread:>16}{faults[form] / (args.rounds * args.steps):>13.0f}")
    read_ms, bandwidth = edge_read_ms(edges, (args.batch_size, args.tokens, args.width))
    print(f"one read of all {edges} edge sources: {read_ms:.2f} ms ({bandwidth:.1f} GB/s); the skip sums need about "
          f"twice that per fwd+bwd from memory")
    return times


def traffic_report(args) -> dict[str, dict[str, float]]:
    """Prints (and returns) the bytes per training step of each form and history dtype."""
    size, patch = DIT_MODELS[args.model]
    depth, width, _ = DIT_SIZES[size]
    tokens = (args.image_size // 8 // patch) ** 2
    N = args.batch_size * tokens * width
    print(f"# aggregation traffic  {args.model}  batch {args.batch_size}  activation {args.batch_size}x{tokens}x{width} "
          f"= {N / 1e6:.1f}M elements ({N * 4 / 1e6:.0f} MB fp32)  {depth} blocks  fp32 stream, bf16 autocast")
    bandwidth = BANDWIDTH_TBS.get(args.gpu)
    print(f"\n{'form':<22}{'history':>8}{'edges':>7}" + "".join(f"{k:>15}" for k in ("fwd read GB", "fwd write GB",
          "bwd read GB", "bwd write GB", "total GB")) + (f"{'ms @ ' + args.gpu:>13}" if bandwidth else "")
          + (f"{'x cascaded':>13}" if args.cascaded_ms else ""))
    layouts = [("dense", traffic.dense_edges(depth))]
    if 1 <= args.topk < depth:
        layouts.append((f"top-{args.topk}", traffic.topk_edges(depth, args.topk)))
    results = {}
    for layout, edges in layouts:
        for form, count in (("stacked (eager)", traffic.stacked_passes), ("stacked (triton)", traffic.triton_passes),
                            ("floor", traffic.floor_passes)):
            for history, nbytes in (("fp32", 4), ("bf16", 2)):
                b = traffic.total_bytes(count(edges, 4, nbytes), N)
                total = sum(b.values())
                row = f"{layout + ' ' + form:<22}{history:>8}{sum(map(len, edges)):>7}" + "".join(
                    f"{v / 1e9:>15.2f}" for v in (*b.values(), total))
                entry = {**{k: v / 1e9 for k, v in b.items()}, "total_gb": total / 1e9}
                if bandwidth:
                    ms = total / (bandwidth * 1e12) * 1e3
                    row += f"{ms:>13.2f}"
                    entry["ms"] = ms
                    if args.cascaded_ms:
                        entry["ratio"] = (args.cascaded_ms + ms) / args.cascaded_ms
                        row += f"{entry['ratio']:>12.3f}x"
                print(row)
                results[f"{layout} {form} {history}"] = entry
    if args.cascaded_ms:
        print(f"x cascaded = (cascaded {args.cascaded_ms:g} ms + bytes / {bandwidth:g} TB/s) / cascaded; "
              "the floor rows are the least any implementation can reach")
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.traffic:
        traffic_report(args)
    else:
        measure(args)


if __name__ == "__main__":
    run_cli(main)
