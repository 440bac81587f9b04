"""The batched latent reader and the training loader: the stored rows, in the sampler's order."""
from __future__ import annotations

import itertools
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from ancre_dit.data.latent_shards import LatentShardDataset
from ancre_dit.training.data import DataInfo, GlobalBatchSampler, collate, load_latents_in_memory, make_loader
from benchmarks import bench_loader


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory) -> Path:
    """7 shards x 13 images of 4x4x4 moments, written with the real shard writer."""
    return bench_loader.write_synthetic_latents(tmp_path_factory.mktemp("latents"), 7, 13, (4, 4, 4), num_classes=5)


def _info(ds: LatentShardDataset) -> DataInfo:
    return DataInfo(ds, "latents", 4, 4, ds.num_classes, 32, 3)


def _stored_rows(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image's (moments (N, 2, 2, C, h, w) [flip][mean, std], label), read with safetensors
    itself: the reference the hand-written positional reads must give back."""
    import json

    from safetensors.torch import load_file

    shards = [load_file(str(root / s["file"])) for s in json.loads((root / "manifest.json").read_text())["shards"]]
    moments = torch.cat([torch.stack([t["mean"], t["std"]], dim=2) for t in shards])
    return moments, torch.cat([t["label"] for t in shards])


def test_get_batch_gives_the_stored_rows_across_evicted_shards(latent_dir):
    ds = LatentShardDataset(latent_dir, max_open_shards=2)  # every batch reopens shards
    assert len(ds) == 91
    stored_x, stored_y = _stored_rows(latent_dir)
    rng = np.random.default_rng(0)
    for indices in ([0], [90, 0, 13, 12, 13], rng.permutation(91)[:40].tolist(), [-1, -91, 5], list(range(91))):
        x, y = ds.get_batch(indices)
        assert x.dtype == torch.float16 and y.dtype == torch.int64
        assert torch.equal(x, stored_x[indices]) and torch.equal(y, stored_y[indices]), indices
        assert len(ds._files_open) <= 2
    for i in (0, 13, 90, -1):
        assert torch.equal(ds[i][0], stored_x[i]) and ds[i][1] == int(stored_y[i])
    x, y = ds.get_batch([])
    assert x.shape == (0, 2, 2, 4, 4, 4) and y.shape == (0,)
    for bad in ([91], [3, -92]):
        with pytest.raises(IndexError, match="out of range"):
            ds.get_batch(bad)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_loader_yields_the_samplers_rows(latent_dir, workers):
    """Same (epoch, offset) start, rank 1 of 2 with 2 accumulation steps, across an epoch boundary:
    with or without workers, every micro-batch is the stored rows of the sampler's indices, bitwise."""
    ds = LatentShardDataset(latent_dir, max_open_shards=3)
    stored_x, stored_y = _stored_rows(latent_dir)

    def sampler():
        return GlobalBatchSampler(len(ds), 16, world=2, rank=1, accum=2, seed=3, epoch=1, offset=32)

    stream = list(itertools.islice(iter(make_loader(_info(ds), sampler(), workers, pin_memory=False)), 12))
    for (x, y), indices in zip(stream, itertools.islice(iter(sampler()), 12)):  # 5 global batches an epoch: into epoch 2
        assert x.shape == (4, 2, 2, 4, 4, 4) and torch.equal(x, stored_x[indices]) and torch.equal(y, stored_y[indices])


def test_the_loader_stacks_datasets_read_one_sample_at_a_time():
    """A dataset without a batched read (the digits, image folders) is read a sample at a time and
    stacked: the same batches as indexing it by hand."""
    from ancre_dit.data.digits import DigitsDataset

    ds = DigitsDataset("train")
    info = DataInfo(ds, "digits", 8, 1, 10, 8, 1)
    loader = make_loader(info, GlobalBatchSampler(len(ds), 8, 1, 0, 1, seed=0), 0, pin_memory=False)
    for (x, y), indices in zip(itertools.islice(iter(loader), 3), GlobalBatchSampler(len(ds), 8, 1, 0, 1, seed=0)):
        ref_x, ref_y = collate([ds[i] for i in indices])
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y) and y.dtype == torch.int64


@pytest.mark.parametrize("workers", [0, 1])
def test_in_memory_latents_give_the_files_batches(latent_dir, workers):
    """data.in_memory: one array read up front; every sample, batch and loader stream is bitwise
    what the shard files give (so exact resume and the 1-vs-N-process equality carry over)."""
    files, memory = LatentShardDataset(latent_dir, max_open_shards=2), LatentShardDataset(latent_dir, in_memory=True)
    assert memory._memory is not None and not memory._files_open  # nothing left open after loading
    for i in (0, 12, 13, 90, -1):
        assert torch.equal(memory[i][0], files[i][0]) and memory[i][1] == files[i][1]
    for indices in ([90, 0, 13, 12, 13], np.random.default_rng(1).permutation(91)[:40].tolist(), [-1, -91]):
        (xa, ya), (xb, yb) = memory.get_batch(indices), files.get_batch(indices)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(IndexError, match="out of range"):
        memory.get_batch([91])
    streams = []
    for ds in (files, memory):
        sampler = GlobalBatchSampler(len(ds), 16, world=2, rank=0, accum=1, seed=5, epoch=0, offset=16)
        streams.append(list(itertools.islice(iter(make_loader(_info(ds), sampler, workers, pin_memory=False)), 9)))
    for (xa, ya), (xb, yb) in zip(*streams):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_in_memory_latents_refused_in_one_line_without_the_ram(latent_dir, monkeypatch):
    import ancre_dit.data.latent_shards as latents
    from ancre_dit.errors import UserError
    from ancre_dit.training.config import load_config
    from ancre_dit.training.data import build_data

    monkeypatch.setattr(latents, "available_memory_bytes", lambda: 10_000)  # the 91 images' moments need 46.6 KB
    with pytest.raises(UserError, match=r"needs 45\.5 KiB .* only 9\.8 KiB of memory is available; set data.in_memory=false"):
        LatentShardDataset(latent_dir, in_memory=True)
    monkeypatch.undo()
    config = load_config(None, ["data.kind=latents", f"data.path={latent_dir}", "data.image_size=32", "data.in_memory=true"])
    info = build_data(config, patch_size=2)
    assert info.dataset._memory is None  # the trainer loads it, once per node (load_latents_in_memory)
    load_latents_in_memory(info, SimpleNamespace(num_processes=1), latent_dir)
    assert info.dataset._memory is not None


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 KiB memory filesystem, as a container's small /dev/shm (needs the right to mount)."""
    import subprocess

    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_in_memory_latents_refused_in_one_line_when_shared_memory_is_small(latent_dir, small_tmpfs, monkeypatch):
    """The 91 images' moments (45.5 KiB) do not fit a 32 KiB /dev/shm: one line naming it, before any
    allocation, not torch's "unable to allocate shared memory"."""
    import ancre_dit.data.latent_shards as latents
    from ancre_dit.errors import UserError

    monkeypatch.setattr(latents, "shared_memory_dir", lambda: small_tmpfs)
    with pytest.raises(UserError, match=rf"needs 45\.5 KiB .* only 32\.0 KiB is free in {small_tmpfs}, the shared-memory filesystem; "
                                        r"give it more .*--shm-size.* or set data.in_memory=false"):
        LatentShardDataset(latent_dir, in_memory=True)
    assert not list(small_tmpfs.iterdir())


@pytest.mark.parametrize("layout", ["v2", "v1", "v2 unlimited"])
def test_in_memory_latents_refused_in_one_line_past_the_jobs_memory_limit(latent_dir, tmp_path, monkeypatch, layout):
    import ancre_dit.data.latent_shards as latents
    from ancre_dit.errors import UserError

    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    limit, usage = ("max" if "unlimited" in layout else str(200_000)), "160000"  # 40 KB left; the latents need 46.6 KB
    if layout.startswith("v2"):
        (root / "memory.max").write_text(limit + "\n")
        (root / "memory.current").write_text(usage + "\n")
    else:
        (root / "memory" / "memory.limit_in_bytes").write_text(limit + "\n")
        (root / "memory" / "memory.usage_in_bytes").write_text(usage + "\n")
    monkeypatch.setattr(latents, "CGROUP_ROOT", root)
    if "unlimited" in layout:
        assert latents.cgroup_memory_left() is None
        LatentShardDataset(latent_dir, in_memory=True)
        return
    assert latents.cgroup_memory_left() == 40_000
    with pytest.raises(UserError, match=r"the job's memory limit leaves .*SLURM --mem.*; raise the limit or set "
                                        r"data.in_memory=false"):
        LatentShardDataset(latent_dir, in_memory=True)


def test_a_crash_while_filling_the_node_copy_leaves_no_file_in_shared_memory(latent_dir, tmp_path, monkeypatch):
    import ancre_dit.data.latent_shards as latents
    from ancre_dit.training.config import load_config
    from ancre_dit.training.data import build_data

    monkeypatch.setattr(latents, "shared_memory_dir", lambda: tmp_path)
    config = load_config(None, ["data.kind=latents", f"data.path={latent_dir}", "data.image_size=32", "data.in_memory=true"])
    info = build_data(config, patch_size=2)
    real_load = latents.LatentShardDataset.load_into_memory

    def crash_after_the_files_exist(self, backing, fill):
        real_load(self, backing, fill)
        raise RuntimeError("killed while filling")

    monkeypatch.setattr(latents.LatentShardDataset, "load_into_memory", crash_after_the_files_exist)
    node = SimpleNamespace(num_processes=2, is_local_main_process=True, device=torch.device("cpu"),
                           reduce=lambda t, op: t, wait_for_everyone=lambda: None)
    with pytest.raises(RuntimeError, match="killed while filling"):
        load_latents_in_memory(info, node, tmp_path / "run")
    assert not list(tmp_path.glob("ancre-dit-latents-*"))


def test_a_node_copy_is_one_set_of_pages_mapped_by_every_local_rank(latent_dir, tmp_path):
    """data.in_memory with several ranks on a node: one fills the files, the others map them; they
    read the same pages (a write through one is seen by the other) and the files' batches."""
    files = LatentShardDataset(latent_dir)
    first, other = LatentShardDataset(latent_dir), LatentShardDataset(latent_dir)
    backing = tmp_path / "node-copy"
    first.load_into_memory(backing, fill=True)
    other.load_into_memory(backing, fill=False)
    indices = [90, 0, 13, 12, 13]
    for ds in (first, other):
        (xa, ya), (xb, yb) = ds.get_batch(indices), files.get_batch(indices)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for part in tmp_path.glob("node-copy.*"):
        part.unlink()  # the mappings outlive the names
    first._memory[0][0].fill_(7)
    assert torch.equal(other[0][0], torch.full_like(other[0][0], 7))


def test_bench_loader_runs(latent_dir, capsys):
    bench = bench_loader
    args = bench.parse_args(["--dir", str(latent_dir), "--shards", "7", "--per-shard", "13", "--latent-side", "4",
                             "--batch-size", "8", "--workers", "0", "--batches", "2", "--warmup", "1", "--rounds", "1"])
    medians = bench.measure(args)
    assert set(medians) == {("batched", 0), ("in-memory", 0)} and all(v > 0 for v in medians.values())
    assert "batched" in capsys.readouterr().out


def test_heldout_slice_of_the_training_latents_keeps_the_batched_read(latent_dir):
    """eval.heldout_from_train=K: training reads the first N-K latents (still a batch at a time),
    the evaluation the last K; the two never overlap."""
    from ancre_dit.training.config import load_config
    from ancre_dit.training.data import build_data

    config = load_config(None, ["data.kind=latents", f"data.path={latent_dir}", "data.image_size=32",
                                "eval.heldout_from_train=10"])
    info = build_data(config, patch_size=2)
    train_set, heldout = info.dataset, info.heldout
    assert (len(train_set), len(heldout)) == (81, 10)
    full = LatentShardDataset(latent_dir)
    indices = [80, 0, 40, 13, 13]
    x, y = train_set.get_batch(indices)  # what the loader calls: one batched read
    ref_x, ref_y = full.get_batch(indices)
    assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
    assert torch.equal(heldout[0][0], full[81][0])  # the held-out part starts where training stops


def test_a_shard_stored_in_another_dtype_is_one_clear_error(latent_dir, tmp_path):
    """Batched reads (from the files or into memory) need one moments dtype across shards."""
    import shutil

    from safetensors.torch import load_file

    from ancre_dit.data.latent_shards import shard_file_name
    from ancre_dit.errors import UserError
    from ancre_dit.latents.shards import write_shard

    mixed = tmp_path / "mixed"
    shutil.copytree(latent_dir, mixed)
    tensors = load_file(str(mixed / shard_file_name(3)))
    tensors = {k: v.float() if k in ("mean", "std") else v for k, v in tensors.items()}
    write_shard(mixed, 3, tensors, {"shard": 3, "count": 13, "report": []})
    ds = LatentShardDataset(mixed)
    ds.get_batch([0, 12])  # shards 0 only: fine
    with pytest.raises(UserError, match=r"shard-00003.* stores torch.float32, other shards torch.float16; re-extract"):
        ds.get_batch([0, 3 * 13])
    with pytest.raises(UserError, match=r"shard-00003.* stores torch.float32, other shards torch.float16; re-extract"):
        LatentShardDataset(mixed, in_memory=True)


def test_only_whole_batches_are_allocated_in_shared_memory_inside_a_worker(latent_dir, monkeypatch):
    """Inside a DataLoader worker a batch is read into shared memory (it crosses to the main process
    without a copy); a single `ds[i]` is not, since a collate stacks it again anyway."""
    from types import SimpleNamespace

    for in_memory in (False, True):
        ds = LatentShardDataset(latent_dir, in_memory=in_memory)
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=0))
        assert ds.get_batch([3, 40])[0].is_shared() and not ds[3][0].is_shared()
        monkeypatch.undo()
        assert not ds.get_batch([3, 40])[0].is_shared()
