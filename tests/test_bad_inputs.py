"""Malformed inputs across every command: each one ends with exit code 2 and exactly one
`error:` line on stderr (no traceback), and no existing output is modified: the whole folder of
inputs and outputs is hashed before and after each command.

The commands run in this process (their `main` through `ancre_dit.cli.run_cli`, as the shell runs
them) so that the table of cases stays fast; tests/test_faults.py runs real processes.
"""
from __future__ import annotations

import hashlib
import json
import runpy
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import ROOT, accelerate_state, tiny_config, tiny_vae, write_latent_dir

from ancre_dit.cli import run_cli  # noqa: E402
from ancre_dit.data.adm_npz import save_adm_npz  # noqa: E402
from ancre_dit.models.topologies import save_topology_json  # noqa: E402
from ancre_dit.training import train  # noqa: E402

SCRIPTS = {"train": ROOT / "train.py", "sample": ROOT / "sample.py", "evaluate": ROOT / "evaluate.py",
           "extract": ROOT / "scripts" / "extract_latents.py", "topology": ROOT / "scripts" / "topology.py",
           "import": ROOT / "scripts" / "import_checkpoint.py", "compare": ROOT / "scripts" / "compare_runs.py"}
LOG_FILES = {"log.txt"}  # a run's text log may grow (e.g. a warning), never change


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 16 + data[16:])


def _image_folder(root: Path, corrupt: bool = False) -> Path:
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    if corrupt:
        (root / "a" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n definitely not a png")
    return root


def _latent_dir(root: Path) -> Path:
    shards = [{"mean": torch.zeros(4, 2, 4, 2, 2).half(), "std": torch.ones(4, 2, 4, 2, 2).half(),
               "label": torch.arange(4) % 2, "index": torch.arange(4) + 4 * k} for k in range(2)]
    return write_latent_dir(root, shards, num_classes=2, image_size=16)


def _manifest_edit(root: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


_HELD_LOCKS: list = []  # lock files held open for the module: another training's claim on a run folder


def _more_inputs(w: Path) -> None:
    """Inputs of the cases on run folders, foreign folders, shards that disagree with their manifest."""
    import fcntl
    from safetensors.torch import save_file

    (w / "empty_config.yaml").write_text("# nothing yet\n")
    (w / "twice_config.yaml").write_text("train: {lr: 1.0e-3}\nmodel: {depth: 2}\ntrain: {max_steps: 4}\n")
    (w / "busy_run").mkdir()
    lock = open(w / "busy_run" / ".lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write("pid 4242 on otherhost\n")
    lock.flush()
    _HELD_LOCKS.append(lock)
    (w / "foreign_jsonl").mkdir()
    (w / "foreign_jsonl" / "manifest.json").write_text('{"id": 1}\n{"id": 2}\n')
    (w / "foreign_jsonl" / "data-0.bin").write_bytes(b"theirs")
    (w / "foreign_list").mkdir()
    (w / "foreign_list" / "manifest.json").write_text("[1, 2]")
    _manifest_edit(_copy(w / "latents", w / "latents_overcount"),
                   lambda m: (m["shards"][0].update(count=5), m.update(num_images=9)))
    _manifest_edit(_copy(w / "latents", w / "latents_listed_twice"),
                   lambda m: (m["shards"].append(dict(m["shards"][0])), m.update(num_images=12)))
    _copy(w / "latents", w / "latents_other_channels")
    save_file({"mean": torch.zeros(4, 2, 3, 2, 2).half(), "std": torch.ones(4, 2, 3, 2, 2).half(),
               "label": torch.arange(4) % 2, "index": torch.arange(4) + 4},
              str(w / "latents_other_channels" / "shard-00001.safetensors"))
    rng = np.random.default_rng(1)
    np.savez(w / "rgba.npz", arr_0=rng.integers(0, 256, (4, 16, 16, 4), dtype=np.uint8), arr_1=np.arange(4))
    np.savez(w / "nchw.npz", arr_0=rng.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8), arr_1=np.arange(4))
    np.savez(w / "empty.npz", arr_0=np.zeros((0, 16, 16, 3), np.uint8), arr_1=np.zeros(0, np.int64))
    np.savez(w / "empty_stats.npz", arr_0=np.zeros((0, 16, 16, 3), np.uint8), mu=np.zeros(2048), sigma=np.eye(2048))
    # Labels that are not what they look like, in each container that reads a label column.
    from containers import make_hf, rewrite_parquet
    rewrite_parquet(w / "parquet", w / "parquet_float_labels", labels=[1.7, 0.0, 1.0, 0.0])
    rewrite_parquet(w / "parquet", w / "parquet_text_labels", labels=["cat", "dog", "cat", "dog"])
    both = w / "parquet_two_class_lists"
    shutil.copytree(w / "parquet", both)
    rewrite_parquet(w / "parquet", w / "parquet_swapped_names", class_names=["b", "a"])
    for part in sorted((w / "parquet_swapped_names").glob("*.parquet")):
        shutil.move(part, both / f"second-{part.name}")
    make_hf(w / "images", w / "hf_disk")
    _hf_float_labels(w / "hf_disk", w / "hf_disk_float_labels")
    # WebDataset tars cut short: at a member boundary (a valid-looking shorter tar), inside a member, garbage.
    from containers import make_wds, replace_in_tar
    tar = next(make_wds(w / "images", w / "wds", per_tar=4).glob("*.tar"))
    import tarfile
    with tarfile.open(tar) as t:
        last = t.getmembers()[-2]  # the last sample's image: cut just before it
    data = tar.read_bytes()
    for name, content in (("wds_cut_at_member", data[:last.offset]), ("wds_cut_inside", data[:last.offset_data + 40]),
                          ("wds_garbage", b"not a tar at all " * 64)):
        (w / name).mkdir()
        (w / name / tar.name).write_bytes(content)
    for name, label in (("wds_float_label", b"1.7"), ("wds_text_label", b"cat")):
        (w / name).mkdir()
        replace_in_tar(tar, w / name / tar.name, lambda member: member.name.endswith(".cls"), label)
    # A parquet file of no bytes beside a good one; a parquet of no rows.
    shutil.copytree(w / "parquet", w / "parquet_with_empty_file")
    (w / "parquet_with_empty_file" / "train-00001-of-00002.parquet").write_bytes(b"")
    import pyarrow.parquet as pq
    (w / "parquet_no_rows").mkdir()
    for part in sorted((w / "parquet").glob("*.parquet")):
        pq.write_table(pq.read_table(part).slice(0, 0), w / "parquet_no_rows" / part.name)
    for image in _copy(w / "images", w / "images_all_unreadable").rglob("*.png"):
        image.write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    # Files cut short in the Hugging Face containers.
    for part in _copy(w / "parquet", w / "parquet_cut").glob("*.parquet"):
        _truncate(part)
    for part in _copy(w / "hf_disk", w / "hf_disk_cut").glob("*.arrow"):
        _truncate(part)
    # Statistics that cannot be right.
    mu, sigma = np.zeros(2048), np.eye(2048)
    np.savez(w / "ref_nan_sigma.npz", mu=mu, sigma=np.full((2048, 2048), np.nan), mu_s=mu, sigma_s=sigma)
    np.savez(w / "ref_no_sigma.npz", mu=mu)
    np.savez(w / "ref_other_dim.npz", mu=np.zeros(64), sigma=np.eye(64))
    np.savez(w / "ref_inf_mu.npz", mu=np.full(2048, np.inf), sigma=sigma)
    for name, edit in (("vae_no_factor", lambda c: c.pop("scaling_factor")), ("vae_big_factor", lambda c: c.update(scaling_factor="big")),
                       ("vae_zero_factor", lambda c: c.update(scaling_factor=0.0))):
        config = json.loads((w / "vae" / "config.json").read_text())
        edit(config)
        _copy(w / "vae", w / name, lambda p, config=config: p.write_text(json.dumps(config)), "config.json")
    (w / "topology_nan.json").write_text('{"probabilities": [[1.0, 0.0], [NaN, NaN]]}')
    # Samples whose labels do not pair with their images; a class folder without images.
    np.savez(w / "few_labels.npz", arr_0=rng.integers(0, 256, (10, 8, 8, 3), dtype=np.uint8), arr_1=np.arange(7))
    np.savez(w / "float_labels.npz", arr_0=rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8),
             arr_1=np.array([1.7, 0.0, 2.0, 3.0]))
    np.savez(w / "labels_beyond_digits.npz", arr_0=rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8),
             arr_1=np.array([1, 12, 2, 3]))
    (_copy(w / "images", w / "images_empty_class") / "c").mkdir()
    _manifest_edit(_copy(w / "latents", w / "latents_empty"), lambda m: m.update(shards=[], num_images=0))
    for shard in (w / "latents_empty").glob("shard-*"):
        shard.unlink()
    spec_path = _copy(w / "latent_run" / "checkpoints" / "0000002", w / "ck_vae_gone") / "model_spec.json"
    spec = json.loads(spec_path.read_text())
    spec["data"]["vae"] = str(w / "vae_moved_away")
    spec_path.write_text(json.dumps(spec))
    (w / "run_empty_metrics" / "logs").mkdir(parents=True)
    (w / "run_empty_metrics" / "logs" / "metrics.jsonl").write_text("")
    # Latent manifests whose statistics were edited.
    _manifest_edit(_copy(w / "extracted", w / "extracted_rescaled"), lambda m: m.update(scaling_factor=0.5))
    for name, edit in (("extracted_tiny_std", lambda m: m["channel_std"].__setitem__(0, 1e-30)),
                       ("extracted_inf_std", lambda m: m["channel_std"].__setitem__(1, float("inf"))),
                       ("extracted_zero_factor", lambda m: m.update(scaling_factor=0)),
                       ("extracted_text_factor", lambda m: m.update(scaling_factor="big"))):
        _manifest_edit(_copy(w / "extracted", w / name), edit)


def _hf_float_labels(src: Path, dst: Path) -> None:
    """A save_to_disk dataset whose label column holds floats."""
    import datasets

    ds = datasets.load_from_disk(str(src))
    labels = [float(y) + 0.5 for y in ds["label"]]
    ds.remove_columns("label").add_column("label", labels).save_to_disk(str(dst))


def _copy(src: Path, dst: Path, damage: Callable[[Path], None] | None = None, *relative: str) -> Path:
    shutil.copytree(src, dst)
    for rel in relative:
        damage(dst / rel)
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Every input the cases need, good and broken, under one folder."""
    w = tmp_path_factory.mktemp("world")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with accelerate_state():
            train(tiny_config(w / "run", "train.max_steps=4", "train.ckpt_every=2"))
        ck = w / "run" / "checkpoints" / "0000004"
        _copy(ck, w / "ck_bad_spec", lambda p: p.write_text("{\n"), "model_spec.json")
        _copy(ck, w / "ck_trunc_ema", _truncate, "ema.safetensors")
        _copy(ck, w / "ck_garbled_model", _garble_header, "model.safetensors")
        _copy(ck, w / "ck_trunc_model", _truncate, "model.safetensors")
        _copy(ck, w / "ck_trunc_optim", _truncate, "accelerate/optimizer.bin")
        _copy(ck, w / "ck_bad_state", lambda p: p.write_text("step: 4"), "trainer_state.json")
        (_copy(ck, w / "ck_no_ema") / "ema.safetensors").unlink()
        _copy(w / "run", w / "run_all_damaged", _truncate, "checkpoints/0000002/ema.safetensors",
              "checkpoints/0000004/model.safetensors")
        # A finished-but-kept sampling job (its parts and job.json), to resume with other settings.
        sample = runpy.run_path(str(SCRIPTS["sample"]))["main"]
        sample(["--ckpt", str(ck), "--num-samples", "2", "--batch-size", "2", "--sampler", "ddim", "--steps", "2",
                "--out", str(w / "job" / "samples.npz"), "--keep-parts", "--cpu"])
        _latent_dir(w / "latents")
        _copy(w / "latents", w / "latents_missing_shard")
        (w / "latents_missing_shard" / "shard-00001.safetensors").unlink()
        _copy(w / "latents", w / "latents_trunc_shard", _truncate, "shard-00000.safetensors")
        _copy(w / "latents", w / "latents_bad_manifest", lambda p: p.write_text("{not json"), "manifest.json")
        _image_folder(w / "images")
        _image_folder(w / "images_corrupt", corrupt=True)
        (w / "flat").mkdir()
        Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(w / "flat" / "x.png")
        (w / "empty_images").mkdir()
        tiny_vae(w / "vae")
        from ancre_dit.latents.extract import ExtractConfig, run_extraction
        run_extraction(ExtractConfig(str(w / "images"), str(w / "vae"), str(w / "extracted"), image_size=16,
                                     shard_size=4, batch_size=4))
        with accelerate_state():
            train(tiny_config(w / "latent_run", "data.kind=latents", f"data.path={w / 'extracted'}",
                              "data.image_size=16", "train.global_batch_size=4", "train.max_steps=2",
                              "train.ckpt_every=2"))
        from containers import make_hf, make_wds, relabel_parquet
        make_hf(w / "images", w / "parquet_jpg", parquet=True, image_column="jpg")
        relabel_parquet(make_hf(w / "images", w / "parquet", parquet=True), w / "parquet_label_5", 5)
        make_wds(w / "images", w / "wds_no_label", drop_label_of=1)
        _copy(w / "vae", w / "vae_unet", lambda p: p.write_text(p.read_text().replace('"AutoencoderKL"', '"UNet2DModel"')),
              "config.json")
        rng = np.random.default_rng(0)
        save_adm_npz(w / "digits.npz", rng.integers(0, 256, (10, 8, 8), dtype=np.uint8), np.arange(10))
        save_adm_npz(w / "nolabels.npz", rng.integers(0, 256, (10, 8, 8), dtype=np.uint8))
        save_adm_npz(w / "big.npz", rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8), np.arange(4))
        (w / "garbage.npz").write_bytes(b"PK\x03\x04 not really a zip")
        _truncate(shutil.copy(w / "digits.npz", w / "truncated.npz"))
        from ancre_dit.evaluation import WEIGHTS_NAME, write_random_inception_weights
        write_random_inception_weights(w / WEIGHTS_NAME, seed=0)
        (w / "corrupt.pth").write_bytes(b"\x00garbage" * 10)
        (w / "bad_config.yaml").write_text("model: {name: DiT-T/2\ntrain: [")
        (w / "list_config.yaml").write_text("- a\n- b\n")
        (w / "topology_broken.json").write_text('{"probabilities": [[1.0, ')
        (w / "topology_nokey.json").write_text('{"matrix": [[1.0]]}')
        (w / "topology_ragged.json").write_text('{"probabilities": [[1.0], [0.5, 0.5, 0.1, 0.2]]}')
        # A plain DiT's all-zero topology; a run whose config.yaml is torn; a flow-matching checkpoint.
        (w / "cascaded_run").mkdir()
        save_topology_json(w / "cascaded_run" / "topology.json", torch.zeros(2, 2), topology="cascaded")
        _copy(w / "run", w / "run_bad_config", lambda p: p.write_text("model: {name: [\n"), "config.yaml")
        from ancre_dit.checkpoint import make_model_spec, write_model_files
        from ancre_dit.models import create_model
        flow_kwargs = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=4, num_classes=10,
                           learn_sigma=False, topology="cascaded")
        flow = create_model("DiT-T/2", **flow_kwargs)
        write_model_files(w / "ck_flow", make_model_spec("DiT-T/2", flow_kwargs, {"objective": "flow", "learn_sigma": False},
                                                          {"kind": "latents", "image_size": 64, "image_channels": 3,
                                                           "num_classes": 10, "vae": None, "scaling_factor": 0.18215},
                                                          1), flow.state_dict(), flow.state_dict())
        (w / "notes.txt").write_text("not a checkpoint\n")
        torch.save(create_model("DiT-T/2", **{**flow_kwargs, "in_channels": 4}).state_dict(), w / "release.pt")
        (w / "a_file").write_text("x")
        _more_inputs(w)
    finally:
        torch.set_num_threads(threads)
    return w


def _cfg(w: Path) -> list[str]:
    return ["--config", str(w / "run" / "config.yaml")]


FRESH = "fresh_run"
# Cases refused while the trainer starts (after the config loaded): a new run folder is removed again.
NO_RUN_FOLDER = {"entropy weight without a learned topology", "latent manifest count beyond a shard's rows",
                 "latent shard listed twice", "latent shard of another channel count", "triton kernels without a GPU",
                 "training data smaller than one batch", "latent folder of no images",
                 "image folder with an empty class folder"}


def _fresh(w: Path) -> str:
    return f"run_dir={w / FRESH}"


def _extract(w: Path, data: str = "images", vae: str = "vae") -> list[str]:
    return ["--data-path", str(w / data), "--vae", str(w / vae), "--out", str(w / "lat"), "--image-size", "16"]


def _fid(w: Path, ref: str, samples: str = "big.npz") -> list[str]:
    return ["--samples", str(w / samples), "--ref", str(w / ref), "--inception-weights", _w8(w), "--metrics", "fid",
            "--device", "cpu"]


def _ck(w: Path) -> str:
    return str(w / "run" / "checkpoints" / "0000004")


def _w8(w: Path) -> str:
    return str(w / "weights-inception-2015-12-05-6726825d.pth")


# (case id, command, argv from the world folder, a piece of the expected message)
CASES: list[tuple[str, str, Callable[[Path], list[str]], str]] = [
    # -- train.py: the config ------------------------------------------------------------------
    ("config missing", "train", lambda w: ["--config", str(w / "nope.yaml")], "not found"),
    ("config not YAML", "train", lambda w: ["--config", str(w / "bad_config.yaml")], "is not valid YAML"),
    ("config not a mapping", "train", lambda w: ["--config", str(w / "list_config.yaml")], "must hold a mapping"),
    ("unknown key", "train", lambda w: [*_cfg(w), _fresh(w), "model.depht=4"], "unknown config key model.depht"),
    ("override not key=value", "train", lambda w: [*_cfg(w), _fresh(w), "train.max_steps"], "is not key=value"),
    ("wrong type", "train", lambda w: [*_cfg(w), _fresh(w), "train.max_steps=many"], "must be a valid integer"),
    ("unknown model", "train", lambda w: [*_cfg(w), _fresh(w), "model.name=DiT-Q/2"], "unknown model"),
    ("unknown topology", "train", lambda w: [*_cfg(w), _fresh(w), "model.topology=spaghetti"], "unknown topology"),
    ("tau zero", "train", lambda w: [*_cfg(w), _fresh(w), "model.tau=0"], "model.tau must be greater than 0, got 0"),
    ("tau nan", "train", lambda w: [*_cfg(w), _fresh(w), "model.tau=.nan"], "model.tau must be a finite number"),
    ("lr zero", "train", lambda w: [*_cfg(w), _fresh(w), "train.lr=0"], "train.lr must be greater than 0, got 0"),
    ("lr inf", "train", lambda w: [*_cfg(w), _fresh(w), "train.lr=inf"], "train.lr must be a valid number"),
    ("ema decay > 1", "train", lambda w: [*_cfg(w), _fresh(w), "train.ema_decay=1.5"], "train.ema_decay"),
    ("adam beta2 = 1", "train", lambda w: [*_cfg(w), _fresh(w), "train.adam_beta2=1.0"], "train.adam_beta2"),
    ("batch zero", "train", lambda w: [*_cfg(w), _fresh(w), "train.global_batch_size=0"], "train.global_batch_size must be greater than or equal to 1"),
    ("negative grad clip", "train", lambda w: [*_cfg(w), _fresh(w), "train.grad_clip=-1"], "train.grad_clip"),
    ("class dropout 1", "train", lambda w: [*_cfg(w), _fresh(w), "model.class_dropout=1"], "model.class_dropout"),
    ("hc streams 0", "train", lambda w: [*_cfg(w), _fresh(w), "model.hc_streams=0"], "model.hc_streams"),
    ("depth 0", "train", lambda w: [*_cfg(w), _fresh(w), "model.depth=0"], "model.depth must be greater than or equal to 1"),
    ("topk above the sources", "train",
     lambda w: [*_cfg(w), _fresh(w), "model.depth=4", "model.topology_topk=4", "train.topology_sparsify_step=2"],
     "the deepest of the 4 blocks has 4 sources"),
    *[(f"topk on {name}", "train",
       lambda w, name=name: [*_cfg(w), _fresh(w), f"model.topology={name}", "model.topology_topk=1",
                             "train.topology_sparsify_step=2"], "applies to topology ancre only")
      for name in ("hc", "mhc", "dar", "attnres")],
    ("sparsify step beyond the run", "train",
     lambda w: [*_cfg(w), _fresh(w), "model.topology_topk=1", "train.topology_sparsify_step=100", "train.max_steps=50"],
     "train.topology_sparsify_step=100 is beyond train.max_steps=50"),
    ("topk without a step", "train", lambda w: [*_cfg(w), _fresh(w), "model.topology_topk=1"],
     "model.topology_topk=1 needs train.topology_sparsify_step"),
    ("sparsify step without topk", "train", lambda w: [*_cfg(w), _fresh(w), "train.topology_sparsify_step=2"],
     "needs model.topology_topk"),
    ("unknown history dtype", "train", lambda w: [*_cfg(w), _fresh(w), "model.history_dtype=float16"],
     "unknown history_dtype 'float16'"),
    ("unknown aggregation kernel", "train", lambda w: [*_cfg(w), _fresh(w), "model.aggregation_kernel=cuda"],
     "unknown aggregation_kernel 'cuda'"),
    ("triton kernels without a GPU", "train", lambda w: [*_cfg(w), _fresh(w), "model.aggregation_kernel=triton"],
     "aggregation_kernel=triton runs its kernels on a CUDA device and none is in use"),
    ("unknown nonfinite policy", "train", lambda w: [*_cfg(w), _fresh(w), "train.nonfinite=ignore"], "train.nonfinite"),
    ("heads do not divide width", "train", lambda w: [*_cfg(w), _fresh(w), "model.num_heads=3"], "not divisible"),
    ("batch not divisible by accumulation", "train", lambda w: [*_cfg(w), _fresh(w), "train.grad_accum=3"],
     "not divisible"),
    ("value of the wrong shape", "train", lambda w: [*_cfg(w), _fresh(w), "train.lr=[1]"],
     "train.lr must be a valid number, got [1]"),
    ("eval section not a mapping", "train", lambda w: [*_cfg(w), _fresh(w), "eval=5"],
     "the eval section must be a mapping"),
    ("eval seed negative", "train", lambda w: [*_cfg(w), _fresh(w), "eval.seed=-1"], "eval.seed must be greater than or equal to 0"),
    ("eval cfg scale negative", "train", lambda w: [*_cfg(w), _fresh(w), "eval.cfg_scales=[2,-1]"],
     "eval.cfg_scales -1.0 is negative"),
    ("eval sampler unknown", "train", lambda w: [*_cfg(w), _fresh(w), "eval.sampler=bogus"],
     "eval.sampler bogus is unknown for diffusion.objective=ddpm; choose"),
    ("eval steps beyond the schedule", "train", lambda w: [*_cfg(w), _fresh(w), "eval.sampler=ddpm", "eval.steps=5000"],
     "eval.steps 5000 must be between 1 and"),
    ("eval fid without a reference", "train", lambda w: [*_cfg(w), _fresh(w), "eval.metrics=[fid]"],
     "need eval.ref"),
    ("eval reference missing", "train",
     lambda w: [*_cfg(w), _fresh(w), "eval.metrics=[fid]", f"eval.ref={w / 'nope.npz'}",
                f"eval.inception_weights={w / 'no.pth'}"], "nope.npz does not exist"),
    ("eval inception weights missing", "train",
     lambda w: [*_cfg(w), _fresh(w), "eval.metrics=[fid]", f"eval.ref={w / 'big.npz'}",
                f"eval.inception_weights={w / 'no.pth'}"], "eval.inception_weights"),
    ("config empty", "train", lambda w: ["--config", str(w / "empty_config.yaml")], "empty_config.yaml is empty"),
    ("config with a key given twice", "train", lambda w: ["--config", str(w / "twice_config.yaml")],
     "line 3: 'train' is given twice"),
    ("run_dir inside a file", "train", lambda w: [*_cfg(w), f"run_dir={w / 'a_file' / 'run'}"],
     "a_file is a file, not a folder"),
    ("run_dir in use by another training", "train", lambda w: [*_cfg(w), f"run_dir={w / 'busy_run'}"],
     "is in use by another training (pid 4242 on otherhost)"),
    ("entropy weight without a learned topology", "train",
     lambda w: [*_cfg(w), _fresh(w), "model.topology=cascaded", "model.topology_entropy_weight=0.1"],
     "model.topology_entropy_weight needs the ancre topology"),
    # -- train.py: the data ----------------------------------------------------------------------
    ("latent dir missing", "train", lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'none'}"],
     "does not exist"),
    ("latent_norm channel without statistics", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'latents'}", "data.image_size=16",
                "data.latent_norm=channel"], "data.latent_norm=channel needs the per-channel statistics"),
    ("data.vae contradicts the latents", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'latents'}", "data.image_size=16",
                f"data.vae={w / 'vae'}"], "makes 4x8x8 latents of 16 px images but the data holds 4x2x2"),
    *[(f"latent manifest with {what}", "train",
       lambda w, name=name: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / name}", "data.image_size=16",
                             "train.global_batch_size=4", "data.latent_norm=channel"], expected)
      for what, name, expected in (
          ("a channel std of 1e-30", "extracted_tiny_std", "channel_std has an entry of 1e-30, at or below 0.0001"),
          ("an infinite channel std", "extracted_inf_std", "channel_mean / channel_std hold a non-finite value"),
          ("a zero scaling factor", "extracted_zero_factor", "has scaling_factor 0, not a positive finite number"),
          ("a text scaling factor", "extracted_text_factor", "has scaling_factor 'big', not a positive finite number"))],
    ("training data smaller than one batch", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'extracted'}", "data.image_size=16",
                "train.global_batch_size=16"],
     "holds 4 samples, fewer than one batch of train.global_batch_size=16; set train.global_batch_size to at most 4"),
    ("latent folder of no images", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'latents_empty'}", "data.image_size=16"],
     "holds no samples; point data.path at a dataset with images"),
    ("latent shard deleted", "train", lambda w: [*_cfg(w), _fresh(w), "data.kind=latents",
                                                 f"data.path={w / 'latents_missing_shard'}"], "lacks 1 shard"),
    ("latent shard truncated", "train", lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", "data.image_size=16",
                                                   "train.global_batch_size=4",
                                                   f"data.path={w / 'latents_trunc_shard'}"], "shard-00000.safetensors"),
    ("latent manifest corrupt", "train", lambda w: [*_cfg(w), _fresh(w), "data.kind=latents",
                                                    f"data.path={w / 'latents_bad_manifest'}"], "not readable JSON"),
    ("latent manifest count beyond a shard's rows", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", "data.image_size=16", f"data.path={w / 'latents_overcount'}"],
     "shard-00000.safetensors holds 4 rows, its manifest entry says 5"),
    ("latent shard listed twice", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", "data.image_size=16", f"data.path={w / 'latents_listed_twice'}"],
     "lists shard-00000.safetensors twice"),
    ("latent shard of another channel count", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", "data.image_size=16",
                f"data.path={w / 'latents_other_channels'}"], "holds latents of shape (3, 2, 2), the manifest says (4, 2, 2)"),
    ("image folder with an unreadable image", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=images", f"data.path={w / 'images_corrupt'}", "data.image_size=16",
                "train.global_batch_size=4"], "0.png is not a readable image"),
    ("image folder with an empty class folder", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=images", f"data.path={w / 'images_empty_class'}", "data.image_size=16"],
     "images_empty_class/c holds no images"),
    ("image folder without class folders", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=images", f"data.path={w / 'empty_images'}", "data.image_size=16"],
     "has no class subfolders"),
    # -- train.py: --resume ----------------------------------------------------------------------
    ("resume path missing", "train", lambda w: [*_cfg(w), "--resume", str(w / "nope")], "not a complete checkpoint"),
    ("resume naming the run folder", "train", lambda w: [*_cfg(w), "--resume", str(w / "run")],
     "is a run folder, not one of its checkpoints; pass --resume auto with run_dir="),
    ("resume another architecture", "train", lambda w: [*_cfg(w), "model.depth=4", "--resume", _ck(w)],
     "depth 2 in the checkpoint, 4 in the config"),
    ("resume another topology", "train", lambda w: [*_cfg(w), "model.topology=cascaded", "--resume", _ck(w)],
     "builds (topology ancre in the checkpoint, cascaded in the config; "),  # the decisive difference first
    ("resume with the latents normalised otherwise", "train",
     lambda w: ["--config", str(w / "latent_run" / "config.yaml"), "data.latent_norm=channel", "--resume",
                str(w / "latent_run" / "checkpoints" / "0000002")],
     "was trained on data the config changes (data.latent_norm scale in the checkpoint, channel in the config"),
    ("resume on latents of another scaling factor", "train",
     lambda w: ["--config", str(w / "latent_run" / "config.yaml"), f"data.path={w / 'extracted_rescaled'}", "--resume",
                str(w / "latent_run" / "checkpoints" / "0000002")], "data.scaling_factor 0.18215 in the checkpoint, 0.5"),
    ("resume broken model_spec.json", "train", lambda w: [*_cfg(w), "--resume", str(w / "ck_bad_spec")],
     "model_spec.json"),
    ("resume truncated ema.safetensors", "train", lambda w: [*_cfg(w), "--resume", str(w / "ck_trunc_ema")],
     "ema.safetensors"),
    ("resume truncated model weights", "train", lambda w: [*_cfg(w), "--resume", str(w / "ck_trunc_model")],
     "model.safetensors"),
    ("resume truncated optimizer state", "train", lambda w: [*_cfg(w), "--resume", str(w / "ck_trunc_optim")],
     "optimizer.bin"),
    ("resume broken trainer_state.json", "train", lambda w: [*_cfg(w), "--resume", str(w / "ck_bad_state")],
     "trainer_state.json"),
    ("resume auto, every checkpoint damaged", "train",
     lambda w: [*_cfg(w), f"run_dir={w / 'run_all_damaged'}", "--resume", "auto"], "every checkpoint"),
    # -- sample.py --------------------------------------------------------------------------------
    ("ckpt missing", "sample", lambda w: ["--ckpt", str(w / "nope"), "--out", str(w / "o.npz")], "not a checkpoint folder"),
    ("ckpt broken model_spec.json", "sample", lambda w: ["--ckpt", str(w / "ck_bad_spec"), "--out", str(w / "o.npz")],
     "ck_bad_spec/model_spec.json is damaged"),
    ("ckpt truncated ema.safetensors", "sample",
     lambda w: ["--ckpt", str(w / "ck_trunc_ema"), "--out", str(w / "o.npz")], "ck_trunc_ema/ema.safetensors is damaged"),
    ("ckpt garbled model.safetensors", "sample",
     lambda w: ["--ckpt", str(w / "ck_garbled_model"), "--weights", "model", "--out", str(w / "o.npz")],
     "ck_garbled_model/model.safetensors is damaged"),
    ("ckpt without ema.safetensors", "sample", lambda w: ["--ckpt", str(w / "ck_no_ema"), "--out", str(w / "o.npz")],
     "is missing"),
    ("cfg scale nan", "sample", lambda w: ["--ckpt", _ck(w), "--cfg-scale", "nan", "--out", str(w / "o.npz")],
     "--cfg-scale nan is not a finite number"),
    ("cfg scale negative", "sample", lambda w: ["--ckpt", _ck(w), "--cfg-scale", "-2", "--out", str(w / "o.npz")],
     "is negative"),
    ("class out of range", "sample", lambda w: ["--ckpt", _ck(w), "--classes", "3,10", "--out", str(w / "o.npz")],
     "out of range"),
    ("zero samples", "sample", lambda w: ["--ckpt", _ck(w), "--num-samples", "0", "--out", str(w / "o.npz")],
     "at least 1"),
    ("out not .npz", "sample", lambda w: ["--ckpt", _ck(w), "--out", str(w / "o.png")], "writes a .npz file"),
    ("guidance interval malformed", "sample",
     lambda w: ["--ckpt", _ck(w), "--guidance-interval", "5", "--out", str(w / "o.npz")], "must be LO,HI"),
    ("guidance interval nan", "sample",
     lambda w: ["--ckpt", _ck(w), "--guidance-interval", "nan,700", "--out", str(w / "o.npz")], "not finite"),
    ("too many steps", "sample", lambda w: ["--ckpt", _ck(w), "--steps", "5000", "--out", str(w / "o.npz")],
     "--steps 5000"),
    ("sampling job resumed with other settings", "sample",
     lambda w: ["--ckpt", _ck(w), "--num-samples", "2", "--batch-size", "2", "--sampler", "ddim", "--steps", "2",
                "--seed", "1", "--out", str(w / "job" / "samples.npz"), "--cpu"], "holds parts of a different job (seed"),
    ("grid of zero samples", "sample",
     lambda w: ["--ckpt", _ck(w), "--out", str(w / "o.npz"), "--grid", str(w / "g.png"), "--grid-max", "0"],
     "--grid-max 0 must be at least 1"),
    # -- evaluate.py ------------------------------------------------------------------------------
    ("samples missing", "evaluate", lambda w: ["--samples", str(w / "nope.npz"), "--digits"], "does not exist"),
    ("samples not a zip", "evaluate", lambda w: ["--samples", str(w / "garbage.npz"), "--digits"], "not a readable ADM"),
    ("samples truncated", "evaluate", lambda w: ["--samples", str(w / "truncated.npz"), "--digits"], "not a readable ADM"),
    ("samples without labels", "evaluate", lambda w: ["--samples", str(w / "nolabels.npz"), "--digits"], "needs images"),
    ("no samples given", "evaluate", lambda w: ["--ref", str(w / "digits.npz")], "pass --samples and --ref"),
    ("inception weights missing", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "big.npz"), "--inception-weights", str(w / "no.pth")],
     "does not exist"),
    ("inception weights corrupt", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "big.npz"), "--inception-weights", str(w / "corrupt.pth")],
     "is not a readable PyTorch weights file"),
    ("inception weights are a DiT checkpoint", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "big.npz"), "--inception-weights",
                str(w / "run" / "checkpoints" / "0000004" / "ema.safetensors")], "inception"),
    ("unknown metric", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "big.npz"), "--inception-weights", _w8(w),
                "--metrics", "fid,beauty", "--device", "cpu"], "beauty"),
    ("batch size zero", "evaluate", lambda w: ["--samples", str(w / "big.npz"), "--batch-size", "0"], "at least 1"),
    ("reference stats without --images", "evaluate",
     lambda w: ["--save-ref-stats", str(w / "ref.npz"), "--inception-weights", _w8(w)], "needs --images"),
    ("reference folder with no images", "evaluate",
     lambda w: ["--save-ref-stats", str(w / "ref.npz"), "--images", str(w / "empty_images"), "--inception-weights",
                _w8(w), "--device", "cpu"], "no image files"),
    ("reference folder with an unreadable image", "evaluate",
     lambda w: ["--save-ref-stats", str(w / "ref.npz"), "--images", str(w / "images_corrupt"), "--inception-weights",
                _w8(w), "--image-size", "16", "--device", "cpu"], "0.png is not a readable image"),
    ("folder of images of different sizes", "evaluate",
     lambda w: ["--samples", str(w / "images_mixed"), "--ref", str(w / "big.npz"), "--inception-weights", _w8(w),
                "--metrics", "is", "--device", "cpu"], "not (20, 24) like the first image"),
    ("samples with 4 channels", "evaluate",
     lambda w: ["--samples", str(w / "rgba.npz"), "--ref", str(w / "big.npz"), "--inception-weights", _w8(w),
                "--metrics", "fid", "--device", "cpu"], "drop the alpha channel, images[..., :3]"),
    ("samples stored channels-first", "evaluate", lambda w: _fid(w, "big.npz", samples="nchw.npz"),
     "it looks channels-first (N, C, H, W): transpose it"),
    ("samples without images", "evaluate",
     lambda w: ["--samples", str(w / "empty.npz"), "--ref", str(w / "big.npz"), "--inception-weights", _w8(w),
                "--metrics", "fid", "--device", "cpu"], "empty.npz) holds no images to evaluate"),
    ("samples without images, with statistics", "evaluate",
     lambda w: ["--samples", str(w / "empty_stats.npz"), "--ref", str(w / "big.npz"), "--inception-weights", _w8(w),
                "--metrics", "fid", "--device", "cpu"], "empty_stats.npz) holds no images to evaluate (arr_0 is empty)"),
    ("reference with statistics but no images, for precision", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "empty_stats.npz"), "--inception-weights", _w8(w),
                "--metrics", "precision", "--device", "cpu"], "empty_stats.npz) holds no images to evaluate"),
    ("reference without images", "evaluate",
     lambda w: ["--samples", str(w / "big.npz"), "--ref", str(w / "empty.npz"), "--inception-weights", _w8(w),
                "--metrics", "fid", "--device", "cpu"], "holds no images to evaluate (arr_0 is empty); pass another --ref"),
    # -- scripts/extract_latents.py ---------------------------------------------------------------
    ("extract without --vae / --out", "extract", lambda w: ["--data-path", str(w / "images")], "missing --vae, --out"),
    ("extract data path missing", "extract",
     lambda w: ["--data-path", str(w / "nope"), "--vae", str(w / "vae"), "--out", str(w / "lat")], "is not a folder"),
    ("extract vae folder missing", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "novae"), "--out", str(w / "lat")], "--vae"),
    ("extract vae folder without config", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "images"), "--out", str(w / "lat")], "config.json"),
    ("extract without class folders", "extract",
     lambda w: ["--data-path", str(w / "flat"), "--vae", str(w / "vae"), "--out", str(w / "lat")], "no class subfolders"),
    ("extract image size not a multiple", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "lat"), "--image-size", "15"],
     "downsampling factor"),
    ("extract fp16 on a CPU", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "lat"), "--vae-dtype", "fp16",
                "--image-size", "16", "--cpu"], "is for GPUs"),
    ("extract zero shard size", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "lat"), "--shard-size", "0",
                "--image-size", "16"], "--shard-size must be positive"),
    ("extract into a different extraction", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "extracted"),
                "--image-size", "16", "--shard-size", "4", "--batch-size", "4", "--min-side", "4"], "different extraction"),
    ("extract into a run folder", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "run"), "--image-size", "16"],
     "holds no latent folder"),
    ("extract into another dataset's folder", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "foreign_jsonl"),
                "--image-size", "16"], "not a latent manifest of this package"),
    ("extract into a folder whose manifest is a list", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "foreign_list"),
                "--image-size", "16"], "not a latent manifest of this package"),
    ("extract parquet without the named columns", "extract",
     lambda w: ["--data-path", str(w / "parquet_jpg"), "--vae", str(w / "vae"), "--out", str(w / "lat")],
     "has no column 'image'"),
    ("extract tar with an image and no label", "extract",
     lambda w: ["--data-path", str(w / "wds_no_label"), "--vae", str(w / "vae"), "--out", str(w / "lat")],
     "has an image but no .cls label"),
    ("extract label outside the class list", "extract",
     lambda w: ["--data-path", str(w / "parquet_label_5"), "--vae", str(w / "vae"), "--out", str(w / "lat")],
     "has label 5, beyond the 2 classes"),
    ("extract vae folder of an unknown class", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae_unet"), "--out", str(w / "lat"),
                "--image-size", "16"], "names the class UNet2DModel"),
    ("extract into a file", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "a_file")], "is a file"),
    ("extract negative max shards", "extract",
     lambda w: [*_extract(w), "--max-shards", "-1"], "--max-shards must be positive, got -1"),
    ("extract scaling factor zero", "extract",
     lambda w: [*_extract(w), "--scaling-factor", "0"], "--scaling-factor 0.0 must be a positive finite number"),
    ("extract scaling factor nan", "extract",
     lambda w: [*_extract(w), "--scaling-factor", "nan"], "--scaling-factor nan must be a positive finite number"),
    ("extract vae config without a scaling factor", "extract",
     lambda w: [*_extract(w, vae="vae_no_factor")], "sets no scaling_factor"),
    ("extract vae config with a text scaling factor", "extract",
     lambda w: [*_extract(w, vae="vae_big_factor")], "has scaling_factor 'big', not a positive number"),
    ("extract vae config with a zero scaling factor", "extract",
     lambda w: [*_extract(w, vae="vae_zero_factor")], "has scaling_factor 0.0, not a positive number"),
    ("extract into the image tree", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "images" / "latents"),
                "--image-size", "16"], "lies inside --data-path"),
    ("extract into the image folder itself", "extract",
     lambda w: ["--data-path", str(w / "images"), "--vae", str(w / "vae"), "--out", str(w / "images"),
                "--image-size", "16"], "is a non-empty folder that holds no latent folder"),
    ("extract parquet float labels", "extract",
     lambda w: [*_extract(w, data="parquet_float_labels")], "holds 1.7 (float), not a class index"),
    ("extract parquet text labels", "extract",
     lambda w: [*_extract(w, data="parquet_text_labels")], "holds 'cat' (str), not a class index"),
    ("extract saved dataset float labels", "extract",
     lambda w: [*_extract(w, data="hf_disk_float_labels")], "holds 0.5 (float), not a class index"),
    ("extract tar cut at a member boundary", "extract", lambda w: [*_extract(w, data="wds_cut_at_member")],
     "without the end-of-archive blocks: the file was cut short"),
    ("extract tar cut inside a member", "extract", lambda w: [*_extract(w, data="wds_cut_inside")],
     "it is damaged or cut short"),
    ("extract garbage tar", "extract", lambda w: [*_extract(w, data="wds_garbage")], "is not a readable tar"),
    ("extract tar with a float label", "extract", lambda w: [*_extract(w, data="wds_float_label")],
     ".cls holds '1.7', not a class index"),
    ("extract tar with a text label", "extract", lambda w: [*_extract(w, data="wds_text_label")],
     ".cls holds 'cat', not a class index"),
    ("extract parquet with an empty file beside a good one", "extract",
     lambda w: [*_extract(w, data="parquet_with_empty_file")],
     "train-00001-of-00002.parquet is not a readable parquet file"),
    ("extract parquet cut short", "extract", lambda w: [*_extract(w, data="parquet_cut")],
     "is not a readable parquet file"),
    ("extract saved dataset cut short", "extract", lambda w: [*_extract(w, data="hf_disk_cut")],
     "hf_disk_cut is not a readable save_to_disk dataset"),
    ("extract a folder of unreadable images", "extract", lambda w: [*_extract(w, data="images_all_unreadable")],
     "none of the 4 images of"),
    ("extract parquet of no rows", "extract", lambda w: [*_extract(w, data="parquet_no_rows")],
     "holds no images (hf: 0 rows)"),
    ("extract parquet files with two class lists", "extract",
     lambda w: [*_extract(w, data="parquet_two_class_lists")], "disagree on their ClassLabel names (class 0: 'a' vs 'b')"),
    # -- statistics and command lines that cannot be right -----------------------------------------
    ("reference with NaN sigma", "evaluate", lambda w: _fid(w, "ref_nan_sigma.npz"), "sigma holds non-finite values"),
    ("reference with an infinite mu", "evaluate", lambda w: _fid(w, "ref_inf_mu.npz"), "mu holds non-finite values"),
    ("reference without sigma", "evaluate", lambda w: _fid(w, "ref_no_sigma.npz"), "holds mu but no sigma"),
    ("reference statistics of another dimension", "evaluate", lambda w: _fid(w, "ref_other_dim.npz"), "do not match"),
    ("reference stats over a file of images", "evaluate",
     lambda w: ["--save-ref-stats", str(w / "big.npz"), "--images", str(w / "images"), "--inception-weights", _w8(w),
                "--image-size", "16", "--device", "cpu"], "holds images (arr_0)"),
    ("reference stats over a file that is not an npz", "evaluate",
     lambda w: ["--save-ref-stats", str(w / "garbage.npz"), "--images", str(w / "images"), "--inception-weights",
                _w8(w), "--image-size", "16", "--device", "cpu"], "is not an .npz of reference statistics"),
    ("key twice on the command line", "train", lambda w: [*_cfg(w), _fresh(w), "train.lr=1e-3", "train.lr=5e-2"],
     "train.lr is given twice on the command line (train.lr=1e-3 and train.lr=5e-2)"),
    ("eval key twice on the command line", "evaluate",
     lambda w: ["--run", str(w / "run"), "eval.num_samples=4", "eval.num_samples=8"], "eval.num_samples is given twice"),
    ("extract an empty class folder", "extract", lambda w: [*_extract(w, data="images_empty_class")],
     "images_empty_class/c holds no images"),
    ("digits samples with fewer labels than images", "evaluate",
     lambda w: ["--samples", str(w / "few_labels.npz"), "--digits"], "holds 10 images (arr_0) but 7 labels (arr_1)"),
    ("digits samples with float labels", "evaluate",
     lambda w: ["--samples", str(w / "float_labels.npz"), "--digits"], "arr_1 holds float64 (4,), not one integer"),
    ("digits of 16x16 RGB samples", "evaluate", lambda w: ["--samples", str(w / "big.npz"), "--digits"],
     "--digits scores the 8x8 samples of a digits run; "),
    ("digits samples with a label beyond 9", "evaluate",
     lambda w: ["--samples", str(w / "labels_beyond_digits.npz"), "--digits"], "--digits needs labels 0..9"),
    ("FID of samples with fewer labels than images", "evaluate", lambda w: _fid(w, "big.npz", samples="few_labels.npz"),
     "holds 10 images (arr_0) but 7 labels"),
    ("sample when the run's VAE is gone", "sample",
     lambda w: ["--ckpt", str(w / "ck_vae_gone"), "--num-samples", "1", "--out", str(w / "o.npz")],
     "vae_moved_away, is not there any more (moved or deleted); pass --vae DIR"),
    ("extract latents beyond float16", "extract", lambda w: [*_extract(w), "--scaling-factor", "1e9"],
     "the VAE ran in fp32, so its weights (or --scaling-factor) give values beyond float16's range"),
    ("latent data.path naming the manifest", "train",
     lambda w: [*_cfg(w), _fresh(w), "data.kind=latents", f"data.path={w / 'latents' / 'manifest.json'}"],
     f"data.path names the latent folder that holds manifest.json and the shards: set data.path="),
    ("extract a brace pattern of missing tars", "extract", lambda w: [*_extract(w, data="imgs{v2}")],
     "a folder whose name holds a brace is read as a pattern of tars: give --format imagefolder"),
    ("negative seed", "sample", lambda w: ["--ckpt", _ck(w), "--seed", "-1", "--out", str(w / "o.npz")],
     "--seed -1 must be a non-negative integer"),
    ("topology with NaN weights", "topology", lambda w: ["show", str(w / "topology_nan.json")], "non-finite weights"),
    # -- scripts/topology.py show ------------------------------------------------------------------
    ("topology missing", "topology", lambda w: ["show", str(w / "nope.json")], "not found"),
    ("topology not JSON", "topology", lambda w: ["show", str(w / "topology_broken.json")], "is not a topology JSON"),
    ("topology without probabilities", "topology", lambda w: ["show", str(w / "topology_nokey.json")],
     "is not a topology JSON"),
    ("topology not a square matrix", "topology", lambda w: ["show", str(w / "topology_ragged.json")],
     "topology_ragged.json"),
    ("topology compare of a plain DiT", "topology", lambda w: ["compare", str(w / "run"), str(w / "cascaded_run"),
                                                               "--out", str(w / "c.png")], "is all zeros"),
    ("topology prune of a plain DiT", "topology",
     lambda w: ["prune", str(w / "cascaded_run"), "--top-k", "1", "--out", str(w / "p.json")], "is all zeros"),
    ("topology compare into a text file", "topology",
     lambda w: ["compare", str(w / "run"), str(w / "run"), "--out", str(w / "x.txt")], "writes a .png file"),
    ("topology compare into a folder", "topology",
     lambda w: ["compare", str(w / "run"), str(w / "run"), "--out", str(w / "images")], "is a folder"),
    ("topology prune into a folder", "topology",
     lambda w: ["prune", str(w / "run"), "--top-k", "1", "--out", str(w / "images")], "is a folder"),
    ("topology evolution into a text file", "topology", lambda w: ["evolution", str(w / "run"), "--out", str(w / "e.txt")],
     "writes a .png file"),
    ("topology show under a file", "topology", lambda w: ["show", str(w / "run"), "--out", str(w / "a_file" / "h.png")],
     "is a file, not a folder"),
    ("topology unknown command", "topology", lambda w: ["draw", str(w / "run")], "invalid choice: 'draw'"),
    ("topology show at a negative time", "topology", lambda w: ["show", str(w / "run"), "--t", "-1"],
     "--t takes normalised times in [0, 1] (0 = data, 1 = noise), got -1.0"),
    ("topology diagnose beyond t = 1", "topology",
     lambda w: ["diagnose", str(w / "run"), "--t", "0.5", "1.5", "--out", str(w / "diag")], "got 0.5 1.5"),
    ("topology diagnose of zero samples", "topology",
     lambda w: ["diagnose", str(w / "run"), "--samples", "0", "--out", str(w / "diag")], "--samples 0 must be at least 1"),
    ("topology diagnose with a negative seed", "topology",
     lambda w: ["diagnose", str(w / "run"), "--seed", "-3", "--out", str(w / "diag")], "--seed -3 must be a non-negative"),
    # -- scripts/import_checkpoint.py ---------------------------------------------------------------
    ("import a text file", "import", lambda w: [str(w / "notes.txt"), "--model", "DiT-T/2", "--out", str(w / "imp")],
     "neither a torch archive nor a pickle"),
    ("import a YAML file", "import",
     lambda w: [str(w / "bad_config.yaml"), "--model", "DiT-T/2", "--out", str(w / "imp")], "not a readable PyTorch"),
    ("import a damaged file", "import", lambda w: [str(w / "corrupt.pth"), "--model", "DiT-T/2", "--out", str(w / "imp")],
     "not a readable PyTorch"),
    ("import into a run folder", "import", lambda w: [str(w / "corrupt.pth"), "--out", str(w / "run")],
     "holds no checkpoint folder"),
    ("import into a file", "import", lambda w: [str(w / "corrupt.pth"), "--out", str(w / "a_file")], "is a file"),
    ("import over an imported checkpoint", "import", lambda w: [str(w / "corrupt.pth"), "--out", _ck(w)],
     "pass --overwrite to replace it"),
    ("import negative image size", "import",
     lambda w: [str(w / "release.pt"), "--model", "DiT-T/2", "--image-size", "-8", "--out", str(w / "imp")],
     "--image-size -8 must be a positive multiple of 8"),
    ("import unknown flag", "import", lambda w: [str(w / "notes.txt"), "--out", str(w / "imp"), "--bogus"],
     "unrecognized arguments: --bogus"),
    # -- scripts/compare_runs.py --------------------------------------------------------------------
    ("compare the same run twice", "compare", lambda w: [str(w / "run"), str(w / "run"), "--out", str(w / "cmp")],
     "is given twice"),
    ("compare a target no run has", "compare",
     lambda w: [str(w / "run"), "--target", "fid/cfg1=3", "--out", str(w / "cmp")], "no run has that metric"),
    ("compare a run with a torn config", "compare",
     lambda w: [str(w / "run"), str(w / "run_bad_config"), "--out", str(w / "cmp")], "is not valid YAML"),
    ("compare a run with an empty metrics log", "compare",
     lambda w: [str(w / "run"), str(w / "run_empty_metrics"), "--out", str(w / "cmp")],
     "logs/metrics.jsonl hold no records yet (the run logged no step)"),
    ("compare into a file", "compare", lambda w: [str(w / "run"), "--out", str(w / "a_file")], "is a file"),
    ("compare under a file", "compare", lambda w: [str(w / "run"), "--out", str(w / "a_file" / "sub")],
     "is a file, not a folder"),
    ("compare into another folder", "compare", lambda w: [str(w / "run"), "--out", str(w / "images")],
     "holds no comparison report"),
    ("compare unknown flag", "compare", lambda w: [str(w / "run"), "--out", str(w / "cmp"), "--bogus"],
     "unrecognized arguments: --bogus"),
    # -- the one parser rule and the protocol -------------------------------------------------------
    ("train unknown flag", "train", lambda w: [*_cfg(w), "--bogus"], "unrecognized arguments: --bogus"),
    ("sample unknown protocol", "sample", lambda w: ["--ckpt", _ck(w), "--protocol", "adm", "--out", str(w / "o.npz")],
     "invalid choice: 'adm'"),
    ("evaluate unknown flag", "evaluate", lambda w: ["--samples", str(w / "digits.npz"), "--bogus"],
     "unrecognized arguments: --bogus"),
    ("extract unknown flag", "extract", lambda w: ["--bogus"], "unrecognized arguments: --bogus"),
    ("protocol dit on a flow checkpoint", "sample",
     lambda w: ["--ckpt", str(w / "ck_flow"), "--protocol", "dit", "--out", str(w / "o.npz")],
     "--protocol dit describes the DiT and ANCRe papers' DDPM-250 numbers, sampled from ddpm checkpoints; this "
     "checkpoint was trained with the flow objective"),
    ("protocol dit on a pixel model", "sample", lambda w: ["--ckpt", _ck(w), "--protocol", "dit", "--out", str(w / "o.npz")],
     "this model has 1 channel(s)"),
    ("sample grid into a folder", "sample",
     lambda w: ["--ckpt", _ck(w), "--out", str(w / "o.npz"), "--grid", str(w / "images")], "is a folder"),
    ("sample pngs into another folder", "sample",
     lambda w: ["--ckpt", _ck(w), "--out", str(w / "o.npz"), "--png-dir", str(w / "images")], "holds no sample PNG"),
    ("evaluate json into a folder", "evaluate",
     lambda w: ["--samples", str(w / "digits.npz"), "--digits", "--json", str(w / "images")], "is a folder"),
]


def _snapshot(root: Path) -> dict[str, str]:
    """relative path -> 'dir' or the sha256 of the file (log files: their bytes, checked append-only)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_dir():
            out[rel] = "dir"
        elif path.name in LOG_FILES:
            out[rel] = path.read_bytes().decode(errors="replace")
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _assert_unmodified(before: dict[str, str], after: dict[str, str]) -> None:
    """Nothing removed or changed; new paths only inside a run dir that did not exist before (a
    fresh run that fails mid-way leaves its log there, which is new output, not modified output)."""
    created = set(after) - set(before)
    assert not set(before) - set(after), f"removed {set(before) - set(after)}"
    assert all(p == FRESH or p.startswith(FRESH + "/") for p in created), f"created {created}"
    for rel, value in before.items():
        if Path(rel).name in LOG_FILES:
            assert after[rel].startswith(value), f"{rel} was rewritten"
        else:
            assert after[rel] == value, f"{rel} was modified"


_MAINS: dict[str, Callable] = {}


def _run(command: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    if command not in _MAINS:
        _MAINS[command] = runpy.run_path(str(SCRIPTS[command]), run_name="bad_inputs")["main"]
    monkeypatch.setattr(sys, "argv", [SCRIPTS[command].name, *argv])
    main = _MAINS[command]
    with accelerate_state(), pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main())
    return exit_info.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def mixed_sizes(world) -> Path:
    folder = world / "images_mixed"
    if not folder.exists():
        folder.mkdir()
        Image.fromarray(np.zeros((20, 24, 3), np.uint8)).save(folder / "0.png")
        Image.fromarray(np.zeros((30, 24, 3), np.uint8)).save(folder / "1.png")
    return folder


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name,command,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(name, command, argv, expected, world, mixed_sizes, monkeypatch,
                                                   capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("ANCRE_DEBUG", raising=False)
    torch.set_num_threads(1)
    args = argv(world)
    before = _snapshot(world)
    code, err = _run(command, args, monkeypatch, capsys)
    if name in NO_RUN_FOLDER and FRESH not in before:
        assert not (world / FRESH).exists(), f"left {sorted(p.name for p in (world / FRESH).iterdir())}"
    if name == "reference without images":
        assert "inception: samples" not in err  # found before the samples' features are computed
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert "Traceback" not in err, err
    assert code == 2, err
    assert len(errors) == 1, err
    assert expected in errors[0], errors[0]
    assert lines[-1] == errors[0], err  # the last word (a run may have logged progress before it)
    _assert_unmodified(before, _snapshot(world))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_resume_auto_skips_a_damaged_newest_checkpoint(world, tmp_path):
    """Not an error: --resume auto warns about the damaged newest checkpoint, takes the previous
    complete one, and the run goes on from there (rewriting the damaged step)."""
    from ancre_dit.training.checkpointing import resolve_resume
    from ancre_dit.checkpoint import load_trained_model

    run = _copy(world / "run", tmp_path / "run", _truncate, "checkpoints/0000004/ema.safetensors")
    warnings: list[str] = []
    assert resolve_resume("auto", run, warn=warnings.append) == run / "checkpoints" / "0000002"
    assert len(warnings) == 1 and "0000004/ema.safetensors" in warnings[0] and "skipping damaged" in warnings[0]
    out = train(tiny_config(run, "train.max_steps=4", "train.ckpt_every=2"), resume="auto")
    assert out["step"] == 4
    assert "skipping damaged checkpoint" in (run / "log.txt").read_text()
    model, spec = load_trained_model(run / "checkpoints" / "0000004")  # rewritten whole
    assert spec["step"] == 4


@pytest.mark.slow
def test_fid_against_a_reference_of_another_resolution_warns(world, caplog):
    from ancre_dit.evaluation.pipeline import evaluate

    with caplog.at_level("WARNING", logger="ancre_dit"):
        # eigh: the distance without sqrtm's 2048 x 2048 matrix root (the warning is what is tested)
        evaluate(world / "big.npz", world / "digits.npz", _w8(world), metrics="fid", device="cpu", fid_method="eigh")
    assert any("the samples are 16x16 but the reference images 8x8" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ancre_dit"):
        evaluate(world / "big.npz", world / "big.npz", _w8(world), metrics="fid", device="cpu", fid_method="eigh")
    assert not [r for r in caplog.records if "reference images" in r.getMessage()]


def test_an_error_under_an_open_progress_bar_starts_its_own_line_and_is_last(capsys):
    """A bar left open (not in a `with` block) is closed before the message: the bar's line ends,
    `error:` starts the next one, and nothing is drawn after it."""
    from tqdm import tqdm

    from ancre_dit.errors import UserError

    def main():
        bar = tqdm(total=10, desc="encoding", file=sys.stderr)
        bar.update(3)
        raise UserError("shard 4 is damaged")

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.endswith("\nerror: shard 4 is damaged\n"), repr(err)
    assert "encoding:  30%" in err.split("\n")[0]
