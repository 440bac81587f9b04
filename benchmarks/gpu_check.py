"""One prepared GPU check: every headline number of a GPU in one short run, the rest after them.

    python -m benchmarks.gpu_check --plan [--budget-s S] [--only NAME ...]   # no GPU needed: the plan
    python -m benchmarks.gpu_check --out results/gpu_check [--budget-s S] [--only NAME ...]
    python -m benchmarks.gpu_check --smoke --out /tmp/gpu_check             # CPU, tiny sizes (a test runs this)
    bash benchmarks/gpu_check_device.sh OUT_DIR                             # a GPU machine without network

The headline items come first, in this order, and fit in the default budget (520 s) on an H200 by
the estimates of gpu_check_estimates.json:

  host syncs   the trainer's own steps with torch.cuda.set_sync_debug_mode: syncs per step that logs
               nothing (0 wanted), dense, top-2 sparse and bf16-history ANCRe
  compiled     DiT-B/2, bf16 autocast, AdamW, batch 256: cascaded, ANCRe dense, top-2 sparse and with a
               bf16 history: step time, images/s, peak memory, MFU, the ratio against cascaded and, for
               ANCRe, its extra time against the traffic model's unavoidable extra (benchmarks/traffic.py)
  eager        DiT-B/2: cascaded, ANCRe with the torch aggregation and (CUDA) with the Triton kernels
  sampling     DDPM-250 at DiT-B/2, guidance 1.5, bf16, batch 256, with and without sample.py's --compile
  train.py     through `accelerate launch` at DiT-B/2, cascaded and ANCRe, compiled, bf16, synthetic latents:
               images/s and MFU from its metrics.jsonl

Then: eager DiT-S/2 and the peer topologies, the latent loader, DPM-Solver and DiT-S/2 sampling,
Inception, a user's whole path (gpu_check_pipeline.py: torchrun, SIGTERM, resume, sample.py,
evaluate.py), the other compiled topologies and the newer variants.

An item starts only when its estimate fits in the budget left and is cut at twice its estimate
(gpu_check_plan.py); every child process runs in its own process group under that limit. An item
that raises is recorded as FAILED and the run goes on. OUT/gpu_check.json and OUT/gpu_check.md are
rewritten after every item, so a run killed at a time limit still leaves what it measured.
`--save-estimates` writes the items' seconds back to benchmarks/gpu_check_estimates.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.hardware import configure_precision, peak_tflops as device_peak_tflops
from ancre_dit.models import create_model
from ancre_dit.models.flops import count_training_flops
from benchmarks.bench_peer import topology_variant
from benchmarks.gpu_check_pipeline import markdown_rows, pipeline_run
from benchmarks.gpu_check_trainer import child_env, trainer_run, trainer_summary

TOPOLOGIES = ("cascaded", "ancre", "denseformer", "hc", "mhc")
# Compiled only, last: a topology or backbone with its options, as bench_peer's variants name them.
NEWER_VARIANTS = ("dar:query=static,chunk=4", "dar:query=static-t,chunk=4", "attnres:block=0",
                  "cascaded:norm=rmsnorm,mlp=swiglu,pos_embed=rope2d,qk_norm=true")
# Compiled, headline: ANCRe sparse (timed with its top-2 wiring) and with its history in bf16.
ANCRE_VARIANTS = ("ancre:topology_topk=2", "ancre:history_dtype=bfloat16")
TRITON = "ancre:aggregation_kernel=triton"  # required: a run where the kernels cannot run fails loudly
TRITON_BF16 = "ancre:aggregation_kernel=triton,history_dtype=bfloat16"
HEADLINE_MODEL = "DiT-B/2"
SMOKE_LIMIT_S = 600.0  # each item's limit in a smoke run (the estimates are a GPU's seconds)
DIFFUSION = {"objective": "ddpm", "learn_sigma": True}  # DiT's schedule (build_objective fills in the rest)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu_check.json and gpu_check.md (required unless --plan)")
    p.add_argument("--plan", action="store_true", help="print the items, their estimates and which fit the budget; "
                   "measure nothing (no GPU needed)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only the items whose name starts with one of these (see --plan)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device (seconds on a CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available (required unless --smoke)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: from the device name)")
    p.add_argument("--budget-s", type=float, default=520.0, help="start an item only while its estimate fits in what is "
                   "left of this")
    p.add_argument("--batch-size", type=int, default=None, help="training batch (default 256; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; smoke 2)")
    p.add_argument("--loader-workers", type=int, default=8)
    p.add_argument("--save-estimates", action="store_true",
                   help="write each finished item's seconds to benchmarks/gpu_check_estimates.json")
    args = p.parse_args(argv)
    if args.plan:
        args.device = args.device or "cuda"
        return args
    if not args.out:
        raise UserError("gpu_check needs --out FOLDER for its report (or --plan to print the plan)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and not args.device.startswith("cuda"):
        raise UserError("gpu_check measures a GPU: run it on a machine with CUDA, or add --smoke for the CPU dry run")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda given but no CUDA device is visible")
    return args


def sizes(args) -> dict:
    if args.smoke:
        tiny = dict(depth=4, hidden_size=32, num_heads=2)  # top-2 keeps fewer edges; DAR chunk 4 divides 8 sublayers
        tiny_overrides = ["model.depth=4", "model.hidden_size=32", "model.num_heads=2"]
        return dict(models={"DiT-S/2": tiny, "DiT-B/2": tiny}, input_size=8,
                    batch=args.batch_size or 2, steps=args.steps or 2, warmup=1, compile_backend="eager",
                    loader=dict(shards=6, per_shard=8, side=4, batch=4, batches=3, workers=min(args.loader_workers, 1)),
                    sampling=dict(images=2, ddpm=3, dpm=2), inception=dict(images=2, batch=2, size=64),
                    host_syncs=dict(side=2, model_overrides=tiny_overrides),
                    trainer=dict(models=("dit-b2",), topologies=("ancre",), other_models=(), shards=2, per_shard=16,
                                 side=2, batch=4, steps=6, log_every=2, workers=1, compile=False,
                                 model_overrides=tiny_overrides),
                    # One process on the CPU: torchrun's start-up would double the smoke's time, and
                    # tests/test_preemption.py covers stops and resumes under torchrun.
                    pipeline=dict(model="dit-s2-ancre", launcher="python", steps=6, log_every=1, workers=1, images=2,
                                  dpm_steps=2, grace_s=300))
    return dict(models={"DiT-S/2": {}, "DiT-B/2": {}}, input_size=32, batch=args.batch_size or 256,
                steps=args.steps or 20, warmup=3, compile_backend="inductor",
                loader=dict(shards=100, per_shard=400, side=32, batch=256, batches=100, workers=args.loader_workers),
                sampling=dict(images=256, ddpm=250, dpm=25), inception=dict(images=1024, batch=256, size=299),
                host_syncs=dict(side=32, model_overrides=[]),
                trainer=dict(models=("dit-b2",), topologies=("cascaded", "ancre"), other_models=("dit-s2",), shards=16,
                             per_shard=1024, side=32, batch=args.batch_size or 256, steps=60, log_every=15, workers=8,
                             compile=True, model_overrides=[]),
                pipeline=dict(model="dit-s2-ancre", launcher="torchrun", steps=200, log_every=10, workers=8, images=256,
                              dpm_steps=25, grace_s=300))


def peak_tflops(args, device: torch.device) -> tuple[float | None, str]:
    value, source = device_peak_tflops(device, args.peak_tflops)
    return value, "--peak-tflops" if source == "given" else source


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_run(name: str, overrides: dict, topology: str, compiled: bool, cfg: dict, device: torch.device) -> dict:
    """Step time, peak memory and FLOPs of one (model, topology, compile) in bf16 autocast."""
    fresh_dynamo()
    torch.manual_seed(0)
    base, options = topology_variant(topology)
    model = create_model(name, topology=base, input_size=cfg["input_size"], in_channels=4, num_classes=1000,
                         **overrides, **options).to(device).train()
    if getattr(model.topology, "topk", 0):  # sparse ANCRe: timed after its switch, with the kept edges only
        model.topology.sparsify()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runner = torch.compile(model, backend=cfg["compile_backend"]) if compiled else model
    g = torch.Generator().manual_seed(0)
    b, s = cfg["batch"], cfg["input_size"]
    x, t, y = (torch.randn(b, 4, s, s, generator=g).to(device), torch.randint(0, 1000, (b,), generator=g).to(device),
               torch.randint(0, 1000, (b,), generator=g).to(device))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = runner(x, t, y)
        out.float().square().mean().backward()
        optimizer.step()

    start = time.perf_counter()
    for _ in range(cfg["warmup"]):
        step()
    sync(device)
    warmup_s = time.perf_counter() - start
    graphs = check_compiled(f"{name} {topology}") if compiled else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    sync(device)
    step_s = (time.perf_counter() - start) / cfg["steps"]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    flops = count_training_flops(model, x, t, y)  # on the eager model (a second or so on a GPU)
    del model, optimizer, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"model": name, "topology": topology, "compile": compiled, "batch": b, "step_ms": step_s * 1e3,
            "images_per_s": b / step_s, "peak_memory_bytes": peak, "flops_per_step": flops,
            "warmup_and_compile_s": warmup_s, "compiled_graphs": graphs}


def fresh_dynamo() -> None:
    """Forget every earlier compile: dynamo recompiles one code object at most
    torch._dynamo.config.recompile_limit times (8), then runs it eager without a word, so the
    later models of one process would otherwise be timed eager under a "compiled" label."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def check_compiled(label: str) -> int:
    """The number of graphs dynamo compiled since fresh_dynamo(); an item meant to run compiled that
    compiled none (it fell back to eager) raises, so it is reported as FAILED, not timed eager."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    if graphs < 1 or not counters["frames"]["ok"]:
        raise RuntimeError(f"{label} was meant to run compiled but dynamo compiled no graph (frames "
                           f"{dict(counters['frames'])}): it would have been timed eager")
    return graphs


def loader_run(cfg: dict) -> dict:
    from benchmarks import bench_loader as bench  # the loader's own benchmark: synthetic shards, timed reads

    c = cfg["loader"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_latents_") as tmp:
        start = time.perf_counter()
        root = bench.write_synthetic_latents(Path(tmp), c["shards"], c["per_shard"], (4, c["side"], c["side"]))
        write_s = time.perf_counter() - start
        rate = bench.loader_images_per_second(root, "batched", c["workers"], c["batch"], c["batches"], warmup=3, seed=0)
        # data.in_memory with no worker: the other way to feed a GPU when the latents fit in RAM
        in_memory = bench.loader_images_per_second(root, "in-memory", 0, c["batch"], c["batches"], warmup=3, seed=0)
        bench.release_in_memory(root)
    return {"images_per_s": rate, "workers": c["workers"], "batch": c["batch"], "shards": c["shards"],
            "images_per_shard": c["per_shard"], "write_s": write_s, "in_memory_0_workers_images_per_s": in_memory}


def sampling_run(name: str, overrides: dict, sampler: str, steps: int, compiled: bool, cfg: dict,
                 device: torch.device) -> dict:
    """Images/s of one sampler with guidance 1.5 in bf16 (latents, no VAE decode), after a short
    warm-up batch (which also compiles, with static shapes, under sample.py's --compile)."""
    from ancre_dit.sampling.api import sample_latents
    from ancre_dit.sampling.guidance import Guidance

    torch.manual_seed(0)
    model = create_model(name, topology="ancre", input_size=cfg["input_size"], in_channels=4, num_classes=1000,
                         **overrides).to(device).eval()
    labels = np.arange(cfg["sampling"]["images"]) % 1000
    precision = "bf16"  # the GPU run's setting; the CPU smoke run takes the same path (CPU autocast)
    common = dict(sampler=sampler, guidance=Guidance(1.5), precision=precision, compile=compiled)
    if compiled:
        fresh_dynamo()
    sample_latents(model, DIFFUSION, labels if compiled else labels[:2], steps=2, **common)
    if compiled:
        check_compiled(f"sampling {name}")
    sync(device)
    start = time.perf_counter()
    sample_latents(model, DIFFUSION, labels, steps=steps, **common)
    sync(device)
    seconds = time.perf_counter() - start
    return {"model": name, "sampler": sampler, "steps": steps, "cfg_scale": 1.5, "images": len(labels),
            "precision": precision, "compile": compiled, "images_per_s": len(labels) / seconds}


def inception_run(cfg: dict, device: torch.device) -> dict:
    from ancre_dit.evaluation.inception import InceptionExtractor, write_random_inception_weights

    c = cfg["inception"]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        extractor = InceptionExtractor(write_random_inception_weights(Path(tmp) / "random-inception.pth"), device=device)
        images = rng.integers(0, 256, (c["batch"], c["size"], c["size"], 3), dtype=np.uint8)
        extractor.batch(images)
        sync(device)
        start = time.perf_counter()
        for _ in range(max(1, c["images"] // c["batch"])):
            extractor.batch(images)
        sync(device)
        seconds = time.perf_counter() - start
    return {"images_per_s": max(1, c["images"] // c["batch"]) * c["batch"] / seconds, "batch": c["batch"],
            "image_size": c["size"], "weights": "random (timing only)"}


def add_ratios_and_mfu(training: list[dict], peak: float | None, device_name: str, cfg: dict) -> None:
    """MFU from each row's FLOP count; time and memory against cascaded with the same compile setting;
    for ANCRe, the extra time against the traffic model's floor."""
    ref = {(r["model"], r["compile"]): r for r in training if r["topology"] == "cascaded" and "step_ms" in r}
    for r in training:
        if "step_ms" not in r:
            continue
        f = r.get("flops_per_step")
        r["achieved_tflops"] = f / (r["step_ms"] / 1e3) / 1e12 if f else None
        r["mfu"] = r["achieved_tflops"] / peak if (f and peak) else None
        base = ref.get((r["model"], r["compile"]))
        r["time_ratio"] = r["step_ms"] / base["step_ms"] if base else None
        r["memory_ratio"] = (r["peak_memory_bytes"] / base["peak_memory_bytes"]
                             if base and r["peak_memory_bytes"] and base["peak_memory_bytes"] else None)
        floor = traffic_floor_ms(r["model"], r["batch"], cfg["input_size"], r["topology"], device_name)
        r["floor_ms"] = floor
        r["extra_ms"] = r["step_ms"] - base["step_ms"] if base else None
        r["extra_over_floor"] = r["extra_ms"] / floor if (floor and r["extra_ms"] is not None) else None


def not_measured(item: dict) -> str:
    if "failed" in item:
        return f"FAILED: {item['failed']}"
    return f"CUT: {item['cut']}" if "cut" in item else f"skipped: {item.get('skipped', 'not run yet')}"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {report['date']}", "",
             f"device: {report['device']}; peak {report['peak_tflops']} TFLOP/s ({report['peak_source']}); "
             f"torch {report['torch']}; smoke {report['smoke']}", "",
             "## Training (bf16 autocast, AdamW; ratios against cascaded with the same compile setting)", "",
             "| model | topology | compile | batch | step ms | images/s | MFU | time ratio | extra / traffic floor | "
             "peak GiB | memory ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["training"]:
        if "step_ms" not in r:
            lines.append(f"| {r['model']} | {r['topology']} | {r['compile']} | {not_measured(r)} ||||||||")
            continue
        peak = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else None
        floor = (f"{r['extra_ms']:.2f} / {r['floor_ms']:.2f} ms = {r['extra_over_floor']:.2f}x"
                 if r.get("extra_over_floor") is not None else "-")
        lines.append(f"| {r['model']} | {r['topology']} | {r['compile']} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{r['images_per_s']:.1f} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['time_ratio'], '.3f')} | {floor} | "
                     f"{_fmt(peak, '.2f')} | {_fmt(r['memory_ratio'], '.3f')} |")
    trainer = report.get("trainer") or {}
    if trainer:
        lines += ["", "## train.py (accelerate launch, bf16, EMA, guard, latent loader; medians after the first log line)",
                  "", "| recipe | processes | batch/process | compile | images/s (all) | images/s per GPU | MFU | wall s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in trainer.get("runs", []):
            if "images_per_s_total" not in r:
                lines.append(f"| {r['model']}-{r['topology']} | {not_measured(r)} |||||||")
                continue
            lines.append(f"| {r['model']}-{r['topology']} | {r['processes']} | {r['batch_per_process']} | {r['compile']} | "
                         f"{r['images_per_s_total']:.1f} | {_fmt(r['images_per_s_per_process'], '.1f')} | {_fmt(r['mfu'], '.1%')} | "
                         f"{r['wall_s']:.0f} |")
    if report.get("pipeline"):
        lines += ["", "## A user's path (torchrun, synthetic latents, tiny random VAE and Inception)", "",
                  *markdown_rows(report["pipeline"])]
    if report.get("host_syncs"):
        lines += ["", "## Host syncs per step (torch.cuda.set_sync_debug_mode, the trainer's own steps)", "",
                  "| recipe | steps that log nothing | syncs in each | at the log steps | where |", "|---|---|---|---|---|"]
        for r in report["host_syncs"]:
            if "syncs_per_quiet_step" not in r:
                lines.append(f"| {r.get('recipe', '-')} | {not_measured(r)} ||||")
                continue
            counts = ", ".join(map(str, r["syncs_per_quiet_step"])) if r["counted"] else "not counted (no CUDA)"
            lines.append(f"| {r['recipe']} | {', '.join(map(str, r['quiet_steps']))} | {counts} | "
                         f"{', '.join(map(str, r['syncs_at_log_steps']))} | {', '.join(r['where_quiet']) or '-'} |")
    lines += ["", "## Other throughputs", ""]
    loader = report.get("loader") or {}
    lines.append(f"- loader: {_fmt(loader.get('images_per_s'), ',.0f')} images/s ({loader.get('workers')} workers, "
                 f"batch {loader.get('batch')}, {loader.get('shards')} shards); data.in_memory with no worker: "
                 f"{_fmt(loader.get('in_memory_0_workers_images_per_s'), ',.0f')} images/s"
                 f"{'' if 'images_per_s' in loader else ' ' + not_measured(loader)}")
    for r in report.get("sampling", []):
        lines.append(f"- sampling {r['model']} {r['sampler']}-{r['steps']} cfg {r['cfg_scale']} ({r['precision']}"
                     f"{', compiled' if r.get('compile') else ''}, batch {r.get('images')}): "
                     f"{r['images_per_s']:.2f} images/s" if "images_per_s" in r
                     else f"- sampling {r['model']} {r.get('sampler')}-{r.get('steps')}: {not_measured(r)}")
    inc = report.get("inception") or {}
    lines.append(f"- inception: {_fmt(inc.get('images_per_s'), ',.1f')} images/s (batch {inc.get('batch')}, "
                 f"{inc.get('image_size')} px, {inc['weights'] if 'weights' in inc else not_measured(inc)})")
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {t['measured']} -> {t['verdict']}")
    lines += ["", "## Items (in the order they ran; * headline)", "", "| item | status | seconds | estimate s | limit s |",
              "|---|---|---|---|---|"]
    for it in report.get("items", []):
        lines.append(f"| {it['name']}{' *' if it['headline'] else ''} | {it['status']} | {it['seconds']:.1f} | "
                     f"{it['estimate_s']:.0f} ({it['estimate_from']}) | {it['limit_s']:.0f} |")
    return "\n".join(lines) + "\n"


def traffic_floor_ms(model: str, batch: int, input_size: int, topology: str, device_name: str) -> float | None:
    """The least time the aggregation's memory traffic costs at the device's bandwidth (traffic.py's
    floor), for ANCRe dense or top-k, fp32 or bf16 history; None for another topology or GPU."""
    from ancre_dit.models.dit import DIT_MODELS, DIT_SIZES
    from benchmarks import traffic

    base, options = topology_variant(topology)
    bandwidth = next((tbs for gpu, tbs in traffic.BANDWIDTH_TBS.items() if gpu in device_name), None)
    if base != "ancre" or bandwidth is None or model not in DIT_MODELS or options.get("aggregation_kernel"):
        return None
    size, patch = DIT_MODELS[model]
    depth, width, _ = DIT_SIZES[size]
    topk = int(options.get("topology_topk", 0))
    edges = traffic.topk_edges(depth, topk) if topk else traffic.dense_edges(depth)
    history = 2 if options.get("history_dtype") == "bfloat16" else 4
    elements = batch * (input_size // patch) ** 2 * width
    total = sum(traffic.total_bytes(traffic.floor_passes(edges, 4, history), elements).values())
    return total / (bandwidth * 1e12) * 1e3


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets(report: dict, smoke: bool) -> list[dict]:
    """The goals of a GPU run, each with what was measured."""
    if smoke:
        return [{"target": "every goal", "measured": "not evaluated", "verdict": "smoke run: tiny sizes, no verdict"}]
    found = []
    for r in report["trainer"].get("runs", []) if report.get("trainer") else []:
        if r.get("model") == "dit-b2" and r.get("mfu") is not None:
            found.append({"target": f"train.py dit-b2-{r['topology']} MFU >= 40%", "measured": f"{r['mfu']:.1%}",
                          "verdict": _verdict(r["mfu"] >= 0.40)})
    for r in report["training"]:
        if r.get("model") != HEADLINE_MODEL or not r.get("compile") or not r.get("time_ratio"):
            continue
        if r.get("extra_over_floor") is not None:
            found.append({"target": f"{HEADLINE_MODEL} compiled {r['topology']}: extra time <= 1.25x the traffic floor",
                          "measured": f"{r['time_ratio']:.3f}x cascaded, extra {r['extra_ms']:.2f} ms = "
                                      f"{r['extra_over_floor']:.2f}x the floor's {r['floor_ms']:.2f} ms",
                          "verdict": _verdict(r["extra_over_floor"] <= 1.25)})
        if "topology_topk=2" in r["topology"]:
            found.append({"target": f"{HEADLINE_MODEL} compiled top-2 ANCRe <= 1.03x cascaded",
                          "measured": f"{r['time_ratio']:.3f}", "verdict": _verdict(r["time_ratio"] <= 1.03)})
    for r in report.get("sampling", []):
        if r.get("model") == HEADLINE_MODEL and r.get("sampler") == "ddpm" and "images_per_s" in r:
            found.append({"target": f"{HEADLINE_MODEL} DDPM-250 sampling >= 23 images/s (compile {r['compile']})",
                          "measured": f"{r['images_per_s']:.2f}", "verdict": _verdict(r["images_per_s"] >= 23)})
    for r in report.get("host_syncs", []):
        if r.get("counted"):
            worst = max(r["syncs_per_quiet_step"])
            found.append({"target": f"0 host syncs in a step that logs nothing ({r['recipe']})",
                          "measured": f"{worst} at most ({', '.join(r['where_quiet']) or 'none'})",
                          "verdict": _verdict(worst == 0)})
    return found


def training_items(models: dict, variants, compiled: bool, headline: bool = False) -> list[tuple]:
    return [(f"train {m} {v} {'compiled' if compiled else 'eager'}", m, o, v, compiled, headline)
            for m, o in models.items() for v in variants]


def build_items(args, cfg: dict, device: torch.device, report: dict, write_report) -> list:
    """Every item in the order it runs: the headline ones first."""
    from benchmarks.gpu_check_plan import Item
    from benchmarks.gpu_check_syncs import host_syncs_run

    cuda = device.type == "cuda"
    head = {HEADLINE_MODEL: cfg["models"][HEADLINE_MODEL]}
    others = {m: o for m, o in cfg["models"].items() if m != HEADLINE_MODEL}
    processes = max(1, torch.cuda.device_count()) if cuda else 1

    def stored(key: str, extra: dict | None = None, single: bool = False):
        """Puts a result (or what stands for it) under report[key]: one dict, or rows added to a list."""
        def store(result):
            if single:
                report[key] = result
            else:
                report.setdefault(key, []).extend(result if isinstance(result, list) else [{**(extra or {}), **result}])
            write_report()
        return store

    def train(name, m, o, v, comp, headline):
        return Item(name, lambda d: training_run(m, o, v, comp, cfg, device),
                    stored("training", {"model": m, "topology": v, "compile": comp}), headline)

    def sampling(m, sampler, steps, comp, headline=False):
        name = f"sampling {m} {sampler}-{steps}{' compiled' if comp else ''}"
        return Item(name, lambda d: sampling_run(m, cfg["models"][m], sampler, steps, comp, cfg, device),
                    stored("sampling", {"model": m, "sampler": sampler, "steps": steps, "compile": comp}), headline)

    trainer_rows: list[dict] = []

    def trainer(m, topo, headline):
        def store(result):
            trainer_rows.append({"model": m, "topology": topo, **result})
            report["trainer"] = trainer_summary(trainer_rows, report["device"], report["peak_tflops"])
            write_report()
        return Item(f"train.py {m}-{topo}", lambda d: trainer_run(m, topo, cfg, device, processes, d),
                    store, headline)

    s = cfg["sampling"]
    # the smoke run compiles only what keeps each path working (inductor on a CPU is slow)
    compile_sampling = not args.smoke
    items = [Item("host syncs per step", lambda d: host_syncs_run(cfg), stored("host_syncs"), True)]
    items += [train(*t) for t in training_items(head, ("cascaded", "ancre", *ANCRE_VARIANTS), True, True)]
    items += [train(*t) for t in training_items(head, ("cascaded", "ancre", *((TRITON,) if cuda else ())), False, True)]
    items += [sampling(HEADLINE_MODEL, "ddpm", s["ddpm"], False, True)]
    items += [sampling(HEADLINE_MODEL, "ddpm", s["ddpm"], True, True)] if compile_sampling else []
    items += [trainer(m, topo, True) for m in cfg["trainer"]["models"] for topo in cfg["trainer"]["topologies"]]
    # the rest
    items += [train(*t) for t in training_items(others, TOPOLOGIES, False)]
    items += [train(*t) for t in training_items(head, TOPOLOGIES[2:] + ((TRITON_BF16,) if cuda else ()), False)]
    items.append(Item("loader", lambda d: loader_run(cfg), stored("loader", single=True)))
    items += [sampling(HEADLINE_MODEL, "dpm-solver", s["dpm"], False)]
    items += [sampling(m, sampler, n, False) for m in others for sampler, n in (("ddpm", s["ddpm"]), ("dpm-solver", s["dpm"]))]
    items.append(Item("inception", lambda d: inception_run(cfg, device), stored("inception", single=True)))
    items.append(Item("pipeline: train, SIGTERM, resume, sample, evaluate",
                      lambda d: pipeline_run(cfg, device, processes, child_env(), d), stored("pipeline")))
    items += [trainer(m, "ancre", False) for m in cfg["trainer"]["other_models"]]
    items += [train(*t) for t in training_items(others, ("cascaded", "ancre"), True)]
    if not args.smoke:
        items += [train(*t) for t in training_items(cfg["models"], TOPOLOGIES[2:], True)]
    items += [train(*t) for t in training_items(head, NEWER_VARIANTS, True)]
    return items


def select(items: list, only: list[str] | None) -> list:
    if not only:
        return items
    chosen = [it for it in items if any(it.name.startswith(prefix) for prefix in only)]
    if not chosen:
        raise UserError(f"--only {' '.join(only)} matches no item; `--plan` lists their names")
    return chosen


def main(argv=None) -> None:
    from benchmarks import gpu_check_plan as plan

    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = sizes(args)
    estimates = plan.load_estimates()
    if args.plan:
        items = select(build_items(args, cfg, device, {"device": "", "peak_tflops": None}, lambda: None), args.only)
        print(plan.format_plan(plan.plan_rows(items, estimates, args.budget_s), args.budget_s))
        return
    budget, started = plan.Deadline(args.budget_s), time.monotonic()
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: a second thread only waits (and thrashes beside other load)
    configure_precision(device)
    peak, peak_source = peak_tflops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": name, "torch": torch.__version__,
              "smoke": args.smoke, "peak_tflops": peak, "peak_source": peak_source, "budget_s": args.budget_s,
              "items": [], "training": [], "sampling": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write_report() -> None:
        """Both files after every item: a run killed at its time limit still leaves what it measured."""
        add_ratios_and_mfu(report["training"], peak, name, cfg)
        report["targets"] = targets(report, args.smoke)
        report["elapsed_s"] = time.monotonic() - started
        for file, text in (("gpu_check.json", json.dumps(report, indent=1)), ("gpu_check.md", markdown(report))):
            (out / f"{file}.tmp").write_text(text)
            os.replace(out / f"{file}.tmp", out / file)

    for item in select(build_items(args, cfg, device, report, write_report), args.only):
        est = plan.estimate_of(item.name, estimates)
        limit = SMOKE_LIMIT_S if args.smoke else plan.CUT_FACTOR * est.seconds  # smoke: CPU seconds, not the GPU's
        status, t0 = "ok", time.perf_counter()
        if not args.smoke and est.seconds > budget.left():
            status, result = "skipped", {"skipped": f"estimate {est.seconds:.0f} s > {budget.left():.0f} s left"}
        else:
            deadline = plan.Deadline(limit)
            try:
                with plan.cut_at(deadline):
                    result = item.measure(deadline)
            except plan.ItemCut as err:
                status, result = "cut", {"cut": str(err)}
            except Exception as err:  # noqa: BLE001 - recorded in the report, traceback on stderr
                # GPU time is costly: one broken item, an out-of-memory say, must not cost the others
                traceback.print_exc()
                status = "failed"
                result = {"failed": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
            if status != "ok" and device.type == "cuda":  # out here, the error's frames no longer hold its tensors
                fresh_dynamo()
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - t0
        print(f"{item.name}: {seconds:.1f} s{'' if status == 'ok' else ' ' + status.upper()}", flush=True)
        report["items"].append({"name": item.name, "headline": item.headline, "status": status, "seconds": seconds,
                                "estimate_s": est.seconds, "estimate_from": est.source, "limit_s": limit})
        item.store(result)
    write_report()
    if args.save_estimates:
        plan.save_estimates(report["items"], name, torch.__version__)
    print(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    run_cli(main)
