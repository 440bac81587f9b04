#!/usr/bin/env python3
"""One prepared GPU check: what a user's GPU will see, in one run of about 8 minutes.

Measures, and writes to OUT/gpu_check.json and OUT/gpu_check.md:

  training   DiT-S/2 and DiT-B/2, bf16 autocast, AdamW, eager and torch.compile, for cascaded,
             ancre, denseformer, hc and mhc, then compiled only for DAR (static and static-t, chunk
             4), full AttnRes and the LightningDiT block: step time, images/s, peak memory
             (torch.cuda.max_memory_allocated), the time and memory ratios against cascaded, and
             MFU = FLOPs of a step (torch.utils.flop_counter.FlopCounterMode, forward + backward,
             attention included)
             / step time / peak dense bf16 FLOP/s of the device (from its name, or --peak-tflops)
  loader     images/s of the trainer's latent loader (synthetic shards, batch 256, 8 workers)
  sampling   images/s of DDPM-250 and DPM-Solver-25 with guidance 1.5, bf16 (latents, no VAE decode)
  inception  images/s of inception-v3-compat feature extraction (random weights: timing only)
  trainer    train.py itself through `accelerate launch` on every GPU (synthetic latents, the recipe's
             bf16, EMA, guard, loader workers and compile): images/s and MFU from its metrics.jsonl
  pipeline   a user's path (gpu_check_pipeline.py): train under torchrun, SIGTERM half way, resume,
             sample.py DDPM-250 and DPM-Solver, evaluate.py with random Inception weights

Work runs in priority order (eager training, which also counts the FLOPs; compiled cascaded and
ancre, which the two targets need, and on CUDA eager ancre with its Triton aggregation kernels and
without; loader, sampling, Inception; then the other compiled topologies,
and last the depth-attention topologies and the LightningDiT block)
and stops starting new items once --budget-s is spent;
skipped items are listed as such. An item that raises is recorded as FAILED with its error (traceback
on stderr) and the run goes on; both files are rewritten after every item, so a run killed at a
time limit still leaves what it measured. Targets (BENCHMARKS.md): ancre at most 1% slower than cascaded
in bf16 with compile, DiT-B/2 training at 40% MFU or more.

    python -m benchmarks.gpu_check --out results/gpu_check
    python -m benchmarks.gpu_check --smoke --out /tmp/gpu_check    # CPU, tiny sizes, seconds (a test runs this)
    bash benchmarks/gpu_check_device.sh OUT_DIR                     # a GPU machine without network (see there)
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
# Compiled, right after compiled cascaded and ancre (their ratios are against compiled cascaded):
# ANCRe with its history in bf16, and sparse ANCRe timed with its top-2 wiring (the smoke run's
# 2-block model keeps 1).
ANCRE_VARIANTS = ("ancre:history_dtype=bfloat16", "ancre:topology_topk=2")
# Eager, on CUDA only, after the compiled runs the targets need: ANCRe's stacked sums as Triton kernels
# (required, so a run where they cannot run fails loudly; with the bf16 history, where they save the
# most bytes) and as the torch ops (what auto takes without triton).
KERNEL_VARIANTS = ("ancre:aggregation_kernel=triton", "ancre:aggregation_kernel=triton,history_dtype=bfloat16",
                   "ancre:aggregation_kernel=torch")
DIFFUSION = {"objective": "ddpm", "learn_sigma": True}  # DiT's schedule (build_objective fills in the rest)


class Budget:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device (seconds on a CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available (required unless --smoke)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: from the device name)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting new measurements after this")
    p.add_argument("--batch-size", type=int, default=None, help="training batch (default 256; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; smoke 2)")
    p.add_argument("--loader-workers", type=int, default=8)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and not args.device.startswith("cuda"):
        raise UserError("gpu_check measures a GPU: run it on a machine with CUDA, or add --smoke for the CPU dry run")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda given but no CUDA device is visible")
    return args


def sizes(args) -> dict:
    if args.smoke:
        return dict(models={"DiT-S/2": dict(depth=2, hidden_size=32, num_heads=2)}, input_size=8,
                    batch=args.batch_size or 2, steps=args.steps or 2, warmup=1, compile_backend="eager",
                    loader=dict(shards=6, per_shard=8, side=4, batch=4, batches=3, workers=min(args.loader_workers, 1)),
                    sampling=dict(images=2, ddpm=3, dpm=2), inception=dict(images=2, batch=2, size=64),
                    trainer=dict(models=("dit-s2",), topologies=("ancre",), shards=2, per_shard=16, side=2, batch=4,
                                 steps=6, log_every=2, workers=1, compile=False,
                                 model_overrides=["model.depth=2", "model.hidden_size=32", "model.num_heads=2"]),
                    # One process on the CPU: torchrun's start-up would double the smoke's time, and
                    # tests/test_preemption.py covers stops and resumes under torchrun.
                    pipeline=dict(model="dit-s2-ancre", launcher="python", steps=6, log_every=1, workers=1, images=2,
                                  dpm_steps=2, grace_s=300))
    return dict(models={"DiT-S/2": {}, "DiT-B/2": {}}, input_size=32, batch=args.batch_size or 256,
                steps=args.steps or 20, warmup=3, compile_backend="inductor",
                loader=dict(shards=100, per_shard=400, side=32, batch=256, batches=100, workers=args.loader_workers),
                sampling=dict(images=256, ddpm=250, dpm=25), inception=dict(images=1024, batch=256, size=299),
                trainer=dict(models=("dit-b2", "dit-s2"), topologies=("ancre", "cascaded"), shards=16, per_shard=1024,
                             side=32, batch=args.batch_size or 256, steps=300, log_every=50, workers=8, compile=True,
                             model_overrides=[]),
                pipeline=dict(model="dit-s2-ancre", launcher="torchrun", steps=200, log_every=10, workers=8, images=256, dpm_steps=25,
                              grace_s=300))


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
    # counted on the eager model: a compiled run takes its eager run's count, and the newer variants,
    # which run compiled only, count their own
    flops = None if compiled and topology in TOPOLOGIES else count_training_flops(model, x, t, y)
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


def sampling_run(name: str, overrides: dict, cfg: dict, device: torch.device) -> list[dict]:
    from ancre_dit.sampling.api import sample_latents
    from ancre_dit.sampling.guidance import Guidance

    torch.manual_seed(0)
    model = create_model(name, topology="ancre", input_size=cfg["input_size"], in_channels=4, num_classes=1000,
                         **overrides).to(device).eval()
    c = cfg["sampling"]
    labels = np.arange(c["images"]) % 1000
    rows = []
    precision = "bf16"  # the GPU run's setting; the CPU smoke run takes the same path (CPU autocast)
    sample_latents(model, DIFFUSION, labels[:2], sampler="dpm-solver", steps=2, guidance=Guidance(1.5), precision=precision)
    # sample.py --compile as well on a GPU (the smoke run leaves it to the test suite: inductor on a CPU is slow)
    runs = [("ddpm", c["ddpm"], False), ("dpm-solver", c["dpm"], False)] + ([] if cfg["compile_backend"] == "eager"
                                                                           else [("ddpm", c["ddpm"], True)])
    for sampler, steps, compiled in runs:
        if compiled:  # one warm-up batch compiles (static shapes: the timed batch has the same size)
            fresh_dynamo()
            sample_latents(model, DIFFUSION, labels, sampler=sampler, steps=2, guidance=Guidance(1.5),
                           precision=precision, compile=True)
            check_compiled(f"sampling {name}")
        sync(device)
        start = time.perf_counter()
        sample_latents(model, DIFFUSION, labels, sampler=sampler, steps=steps, guidance=Guidance(1.5), precision=precision,
                       compile=compiled)
        sync(device)
        seconds = time.perf_counter() - start
        rows.append({"model": name, "sampler": sampler, "steps": steps, "cfg_scale": 1.5, "images": len(labels),
                     "precision": precision, "compile": compiled, "images_per_s": len(labels) / seconds})
    return rows


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


def add_ratios_and_mfu(training: list[dict], peak: float | None) -> None:
    flops = {(r["model"], r["topology"]): r["flops_per_step"] for r in training if r.get("flops_per_step")}
    ref = {(r["model"], r["compile"]): r for r in training if r["topology"] == "cascaded" and "step_ms" in r}
    for r in training:
        if "step_ms" not in r:
            continue
        f = flops.get((r["model"], r["topology"]))
        r["achieved_tflops"] = f / (r["step_ms"] / 1e3) / 1e12 if f else None
        r["mfu"] = r["achieved_tflops"] / peak if (f and peak) else None
        base = ref.get((r["model"], r["compile"]))
        r["time_ratio"] = r["step_ms"] / base["step_ms"] if base else None
        r["memory_ratio"] = (r["peak_memory_bytes"] / base["peak_memory_bytes"]
                             if base and r["peak_memory_bytes"] and base["peak_memory_bytes"] else None)


def not_measured(item: dict) -> str:
    return f"FAILED: {item['failed']}" if "failed" in item else f"skipped: {item.get('skipped', 'not run yet')}"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {report['date']}", "",
             f"device: {report['device']}; peak {report['peak_tflops']} TFLOP/s ({report['peak_source']}); "
             f"torch {report['torch']}; smoke {report['smoke']}", "",
             "## Training (bf16 autocast, AdamW; ratios against cascaded with the same compile setting)", "",
             "| model | topology | compile | batch | step ms | images/s | MFU | time ratio | peak GiB | memory ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["training"]:
        if "step_ms" not in r:
            lines.append(f"| {r['model']} | {r['topology']} | {r['compile']} | {not_measured(r)} |||||||")
            continue
        peak = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else None
        lines.append(f"| {r['model']} | {r['topology']} | {r['compile']} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{r['images_per_s']:.1f} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['time_ratio'], '.3f')} | "
                     f"{_fmt(peak, '.2f')} | {_fmt(r['memory_ratio'], '.3f')} |")
    trainer = report.get("trainer") or {}
    if trainer:
        lines += ["", "## train.py (accelerate launch, bf16, EMA, guard, latent loader; medians after the first log line)",
                  "", "| recipe | processes | batch/process | compile | images/s (all) | images/s per GPU | MFU | wall s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in trainer.get("runs", []):
            if "images_per_sec" not in r:
                lines.append(f"| {r['model']}-{r['topology']} | {not_measured(r)} |||||||")
                continue
            lines.append(f"| {r['model']}-{r['topology']} | {r['processes']} | {r['batch_per_process']} | {r['compile']} | "
                         f"{r['images_per_sec']:.1f} | {_fmt(r['images_per_s'], '.1f')} | {_fmt(r['mfu'], '.1%')} | "
                         f"{r['wall_s']:.0f} |")
    if report.get("pipeline"):
        lines += ["", "## A user's path (torchrun, synthetic latents, tiny random VAE and Inception)", "",
                  *markdown_rows(report["pipeline"])]
    lines += ["", "## Other throughputs", ""]
    loader = report.get("loader") or {}
    lines.append(f"- loader: {_fmt(loader.get('images_per_s'), ',.0f')} images/s ({loader.get('workers')} workers, "
                 f"batch {loader.get('batch')}, {loader.get('shards')} shards); data.in_memory with no worker: "
                 f"{_fmt(loader.get('in_memory_0_workers_images_per_s'), ',.0f')} images/s"
                 f"{'' if 'images_per_s' in loader else ' ' + not_measured(loader)}")
    for r in report.get("sampling", []):
        lines.append(f"- sampling {r['model']} {r['sampler']}-{r['steps']} cfg {r['cfg_scale']} ({r['precision']}"
                     f"{', compiled' if r.get('compile') else ''}, batch {r.get('images')}): "
                     f"{r['images_per_s']:.2f} images/s" if "images_per_s" in r else f"- sampling {r['model']}: {not_measured(r)}")
    inc = report.get("inception") or {}
    lines.append(f"- inception: {_fmt(inc.get('images_per_s'), ',.1f')} images/s (batch {inc.get('batch')}, "
                 f"{inc.get('image_size')} px, {inc['weights'] if 'weights' in inc else not_measured(inc)})")
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {t['measured']} -> {t['verdict']}")
    return "\n".join(lines) + "\n"


def targets(training: list[dict], smoke: bool) -> list[dict]:
    found = []
    if smoke:
        return [{"target": "ancre <= 1.01x cascaded (bf16 + compile); DiT-B/2 MFU >= 40%",
                 "measured": "not evaluated", "verdict": "smoke run: tiny sizes, no verdict"}]
    for r in training:
        if r.get("topology") == "ancre" and r.get("compile") and "time_ratio" in r and r["time_ratio"]:
            found.append({"target": f"{r['model']} ancre / cascaded step time, bf16 + compile <= 1.01",
                          "measured": f"{r['time_ratio']:.3f}", "verdict": "met" if r["time_ratio"] <= 1.01 else "NOT met"})
        if r.get("model") == "DiT-B/2" and r.get("topology") == "cascaded" and r.get("mfu") is not None:
            found.append({"target": f"DiT-B/2 cascaded training MFU >= 40% (compile {r['compile']})",
                          "measured": f"{r['mfu']:.1%}", "verdict": "met" if r["mfu"] >= 0.40 else "NOT met"})
    return found


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = sizes(args)
    budget = Budget(args.budget_s)
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: a second thread only waits (and thrashes beside other load)
    configure_precision(device)
    peak, peak_source = peak_tflops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": name, "torch": torch.__version__,
              "smoke": args.smoke, "peak_tflops": peak, "peak_source": peak_source, "budget_s": args.budget_s,
              "training": [], "sampling": []}

    def guarded(label: str, fn):
        """Runs one item; a failure is recorded and the run goes on (GPU time is costly: one
        broken item, an out-of-memory say, must not cost the others)."""
        if budget.left() <= 0:
            print(f"skip {label}: budget spent", flush=True)
            return {"skipped": "budget spent"}
        t0 = time.perf_counter()
        failure = None
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - recorded in the report, traceback on stderr
            traceback.print_exc()
            failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        if failure is not None:
            result = {"failed": failure}
            if device.type == "cuda":  # out here, the error's frames no longer hold the item's tensors
                torch.cuda.empty_cache()
        print(f"{label}: {time.perf_counter() - t0:.1f} s{' FAILED' if 'failed' in result else ''}", flush=True)
        return result

    plan = [(m, o, topo, False) for m, o in cfg["models"].items() for topo in TOPOLOGIES]
    for_targets = [(m, o, topo, True) for topo in ("cascaded", "ancre") for m, o in cfg["models"].items()]
    for_targets += [(m, o, v.replace("topk=2", "topk=1") if args.smoke else v, True)
                    for v in ANCRE_VARIANTS for m, o in cfg["models"].items()]
    if device.type == "cuda":  # the kernels' device
        for_targets += [(m, o, v, False) for v in KERNEL_VARIANTS for m, o in cfg["models"].items()]
    # the smoke run compiles cascaded, ancre and the newer variants (options through create_model):
    # enough to keep each path working
    other_compiled = [] if args.smoke else [(m, o, topo, True) for m, o in cfg["models"].items() for topo in TOPOLOGIES[2:]]
    other_compiled += [(m, o, variant, True) for m, o in cfg["models"].items() for variant in NEWER_VARIANTS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write_report() -> None:
        """Both files after every item: a run killed at its time limit still leaves what it measured."""
        add_ratios_and_mfu(report["training"], peak)
        report["targets"] = targets(report["training"], args.smoke)
        report["elapsed_s"] = time.perf_counter() - budget.start
        for name, text in (("gpu_check.json", json.dumps(report, indent=1)), ("gpu_check.md", markdown(report))):
            (out / f"{name}.tmp").write_text(text)
            os.replace(out / f"{name}.tmp", out / name)

    def train_item(m: str, o: dict, topo: str, comp: bool) -> None:
        r = guarded(f"train {m} {topo} compile={comp}", lambda: training_run(m, o, topo, comp, cfg, device))
        report["training"].append({"model": m, "topology": topo, "compile": comp, **r})
        write_report()

    for item in plan + for_targets:
        train_item(*item)
    processes = max(1, torch.cuda.device_count()) if device.type == "cuda" else 1
    pipeline = guarded("pipeline: train, SIGTERM, resume, sample, evaluate",
                       lambda: pipeline_run(cfg, device, processes, child_env()))
    report["pipeline"] = pipeline if isinstance(pipeline, list) else [{"stage": "pipeline", **pipeline}]
    write_report()
    trainer_rows = []
    for m in cfg["trainer"]["models"]:
        for topo in cfg["trainer"]["topologies"]:
            r = guarded(f"train.py {m}-{topo} x{processes}", lambda: trainer_run(m, topo, cfg, device, processes))
            trainer_rows.append({"model": m, "topology": topo, **r})
            report["trainer"] = trainer_summary(trainer_rows, name, peak)
            write_report()
    report["loader"] = guarded("loader", lambda: loader_run(cfg))
    write_report()
    for m, o in cfg["models"].items():
        rows = guarded(f"sampling {m}", lambda: sampling_run(m, o, cfg, device))
        report["sampling"] += rows if isinstance(rows, list) else [{"model": m, **rows}]
        write_report()
    report["inception"] = guarded("inception", lambda: inception_run(cfg, device))
    write_report()
    for item in other_compiled:
        train_item(*item)
    print(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    run_cli(main)
