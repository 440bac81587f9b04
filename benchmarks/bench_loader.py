#!/usr/bin/env python3
"""Images/s of the training input pipeline on latent shards (the trainer's own loader).

Writes synthetic shards in our format with the real shard writer (default: 100 shards x 1,000
images at the ImageNet-256 latent shape 4x32x32, about 3.3 GB; reused when already there), then
iterates the trainer's own loader (`LatentShardDataset` + `GlobalBatchSampler` + `make_loader`,
one process, global batch 256) for each worker count and read path:

    batched     one `get_batch` per micro-batch: the rows of each shard read by positional reads
                straight into the batch tensor (in a worker: a shared-memory tensor, as torch's
                default collate makes)
    in-memory   `data.in_memory=true`: every shard read once into RAM (not timed; its load time is
                printed), then one `index_select` per micro-batch

The 256 rows of a shuffled batch come from nearly every shard, more than the 64 shard handles a
process keeps open. Rounds are interleaved (every configuration once per round); the median over
rounds is reported.

    python -m benchmarks.bench_loader                          # 100 shards x 1,000 images, batch 256
    python -m benchmarks.bench_loader --workers 8 --paths batched --batches 200
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ancre_dit.cli import run_cli
from ancre_dit.data.latent_shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, LatentShardDataset, shard_file_name
from ancre_dit.errors import UserError
from ancre_dit.latents.shards import write_shard
from ancre_dit.training.data import DataInfo, GlobalBatchSampler, make_loader

PATHS = ("batched", "in-memory")
_IN_MEMORY: dict[Path, LatentShardDataset] = {}  # loaded once per run, shared by its rounds


def open_dataset(root: Path, path: str) -> LatentShardDataset:
    if path != "in-memory":
        return LatentShardDataset(root)
    if root not in _IN_MEMORY:
        start = time.perf_counter()
        _IN_MEMORY[root] = LatentShardDataset(root, in_memory=True)
        print(f"# in-memory: {len(_IN_MEMORY[root])} images loaded in {time.perf_counter() - start:.1f} s (not timed below)")
    return _IN_MEMORY[root]


def release_in_memory(root: Path) -> None:
    """Frees the in-memory copy `open_dataset` keeps for `root` (its rounds are over)."""
    _IN_MEMORY.pop(root, None)


def write_synthetic_latents(out: Path, shards: int, per_shard: int, latent_shape=(4, 32, 32),
                            num_classes: int = 1000, seed: int = 0) -> Path:
    """A latent directory in the extractor's format (random moments) written with `write_shard`;
    an existing one with the same sizes is reused."""
    out = Path(out)
    sizes = {"shards": shards, "per_shard": per_shard, "latent_shape": list(latent_shape), "num_classes": num_classes,
             "seed": seed}
    manifest_path = out / MANIFEST_NAME
    if manifest_path.is_file() and json.loads(manifest_path.read_text()).get("synthetic") == sizes:
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    entries = []
    for k in range(shards):
        shape = (per_shard, 2, *latent_shape)
        tensors = {"mean": torch.randn(shape, generator=g).half(),
                   "std": (0.1 * torch.rand(shape, generator=g)).half(),
                   "label": torch.randint(0, num_classes, (per_shard,), generator=g),
                   "index": torch.arange(k * per_shard, (k + 1) * per_shard)}
        digest = write_shard(out, k, tensors, {"shard": k, "count": per_shard, "report": []})
        entries.append({"file": shard_file_name(k), "count": per_shard, "sha256": digest})
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "num_images": shards * per_shard,
                "num_classes": num_classes, "latent_shape": list(latent_shape), "image_size": 8 * latent_shape[1],
                "scaling_factor": 0.18215, "vae": None, "shards": entries, "synthetic": sizes}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return out


def loader_images_per_second(root: Path, path: str, workers: int, batch: int, batches: int, warmup: int,
                             seed: int, cpu_rates: list[float] | None = None) -> float:
    """Images/s of `batches` micro-batches from the trainer's loader, after `warmup` (worker start).
    With no worker, also appends images per CPU-second of this process to `cpu_rates`: on a shared
    machine that shows what the path costs, independent of how much CPU the others leave."""
    ds = open_dataset(root, path)
    info = DataInfo(ds, "latents", ds.latent_shape[1], ds.latent_shape[0], ds.num_classes, 256, 3)
    sampler = GlobalBatchSampler(len(ds), batch, 1, 0, 1, seed)
    loader = make_loader(info, sampler, workers, pin_memory=False)
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        x, y = next(it)
        assert x.shape[0] == batch
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    del it, loader
    if cpu_rates is not None and workers == 0:  # all the reading happens in this process: its CPU time is the cost
        cpu_rates.append(batch * batches / cpu)
    return batch * batches / elapsed


def run_benchmark(root: Path, paths, workers, batch: int, batches: int, warmup: int, rounds: int,
                  seed: int = 0) -> dict[tuple[str, int], list[float]]:
    results: dict[tuple[str, int], list[float]] = {(p, w): [] for p in paths for w in workers}
    cpu_rates: dict[tuple[str, int], list[float]] = {key: [] for key in results}
    configs = list(results)
    for r in range(rounds):
        k = r % len(configs)
        for path, w in configs[k:] + configs[:k]:
            results[(path, w)].append(loader_images_per_second(root, path, w, batch, batches, warmup, seed + r,
                                                               cpu_rates[(path, w)]))
    return results, cpu_rates


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the synthetic shards go (default: a temporary folder, removed)")
    p.add_argument("--shards", type=int, default=100)
    p.add_argument("--per-shard", type=int, default=1000)
    p.add_argument("--latent-side", type=int, default=32, help="32 = ImageNet 256x256")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--batches", type=int, default=40, help="timed batches per configuration and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.shards, args.per_shard, args.batch_size, args.batches, args.rounds) < 1:
        raise UserError("--shards, --per-shard, --batch-size, --batches and --rounds must be at least 1")
    if args.shards * args.per_shard < args.batch_size:
        raise UserError("--shards x --per-shard must hold at least one batch")
    return args


def measure(args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """Runs the benchmark, prints the table; returns {(path, workers): median images/s}."""
    tmp = None if args.dir else tempfile.mkdtemp(prefix="ancre_bench_loader_")
    root = Path(args.dir or tmp)
    try:
        start = time.perf_counter()
        write_synthetic_latents(root, args.shards, args.per_shard, (4, args.latent_side, args.latent_side))
        print(f"# bench_loader  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  torch {torch.__version__}  "
              f"{platform.machine()}  {os.cpu_count()} cpus  load average {os.getloadavg()[0]:.2f}")
        print(f"# {args.shards} shards x {args.per_shard} images of 4x{args.latent_side}x{args.latent_side} fp16 moments "
              f"in {root} (ready in {time.perf_counter() - start:.0f} s), batch {args.batch_size}, "
              f"{args.batches} batches x {args.rounds} interleaved rounds (median), 64 shard handles per process")
        results, cpu_rates = run_benchmark(root, args.paths, args.workers, args.batch_size, args.batches, args.warmup,
                                           args.rounds)
    finally:
        release_in_memory(root)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'path':<12}{'workers':>8}{'images/s':>12}{'min..max':>20}{'images/CPU-s':>15}")
    medians = {}
    for (path, w), values in results.items():
        medians[(path, w)] = statistics.median(values)
        per_cpu = f"{statistics.median(cpu_rates[(path, w)]):,.0f}" if cpu_rates[(path, w)] else "-"
        print(f"{path:<12}{w:>8}{medians[(path, w)]:>12,.0f}{f'{min(values):,.0f}..{max(values):,.0f}':>20}{per_cpu:>15}")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return medians


def main(argv=None) -> None:
    measure(parse_args(argv))


if __name__ == "__main__":
    run_cli(main)
