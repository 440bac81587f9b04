"""Extraction from the containers users hold ImageNet in: an image folder, a Hugging Face dataset
(save_to_disk and parquet) and WebDataset tars, built here from the same tiny images."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from containers import CLASSES, make_hf, make_image_folder, make_wds, replace_in_tar
from helpers import one_torch_thread, tiny_vae
from safetensors.torch import load_file

from ancre_dit.errors import UserError
from ancre_dit.latents.extract import ExtractConfig, run_extraction
from ancre_dit.latents.image_datasets import detect_format, open_source
from ancre_dit.latents.shards import verify_latent_dir

SIZE = 16


@pytest.fixture(scope="module")
def containers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("containers")
    folder = make_image_folder(root / "folder")
    return {"imagefolder": folder, "hf": make_hf(folder, root / "hf_disk"),
            "parquet": make_hf(folder, root / "hf_parquet", parquet=True), "wds": make_wds(folder, root / "wds")}


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> Path:
    return tiny_vae(tmp_path_factory.mktemp("vae"))


def test_container_detected_from_the_path(containers):
    assert detect_format(str(containers["imagefolder"])) == "imagefolder"
    assert detect_format(str(containers["hf"])) == "hf"
    assert detect_format(str(containers["parquet"])) == "hf"
    assert detect_format(str(containers["wds"])) == "wds"
    assert detect_format(str(containers["wds"] / "train-{0000..0001}.tar")) == "wds"


def test_an_existing_folder_with_a_brace_in_its_name_is_a_folder(containers, tmp_path):
    import shutil

    braced = shutil.copytree(containers["imagefolder"], tmp_path / "imgs{v1}")
    assert detect_format(str(braced)) == "imagefolder"
    assert open_source(str(braced)).files == open_source(str(containers["imagefolder"])).files


def test_listings_agree(containers):
    sources = {k: open_source(str(p)) for k, p in containers.items()}
    sources["pattern"] = open_source(str(containers["wds"] / "train-{0000..0001}.tar"))
    for name, s in sources.items():
        assert s.labels == [0, 0, 1, 1, 2, 2], name
    assert sources["hf"].class_names == sources["parquet"].class_names == CLASSES
    assert sources["wds"].class_names == ["0", "1", "2"]  # tars carry indices only
    crops = {k: [it.array for it in map(s.images(SIZE, 8).__getitem__, range(6))] for k, s in sources.items()}
    for k in crops:
        assert all(np.array_equal(a, b) for a, b in zip(crops[k], crops["imagefolder"])), k


def test_three_containers_give_bitwise_the_same_latents(containers, vae_dir, tmp_path):
    shards = {}
    for name, path in containers.items():
        cfg = ExtractConfig(data_path=str(path), vae=str(vae_dir), out=str(tmp_path / name), image_size=SIZE,
                            shard_size=4, batch_size=3)
        with one_torch_thread():
            run_extraction(cfg)
        manifest, problems = verify_latent_dir(tmp_path / name, progress=False)
        assert problems == []
        assert manifest["source"]["format"] == ("hf" if name == "parquet" else name)
        assert manifest["num_images"] == 6
        shards[name] = [load_file(tmp_path / name / f"shard-{k:05d}.safetensors") for k in range(2)]
    for name in ("hf", "parquet", "wds"):
        for a, b in zip(shards[name], shards["imagefolder"]):
            for key in ("mean", "std", "label", "index"):
                assert torch.equal(a[key], b[key]), (name, key)
    hf_manifest = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert hf_manifest["class_names"] == CLASSES
    assert hf_manifest["source"] == {"format": "hf", "path": str(containers["hf"]), "image_column": "image",
                                     "label_column": "label"}


def test_forced_format_and_named_columns(containers, tmp_path):
    renamed = make_hf(containers["imagefolder"], tmp_path / "renamed", image_column="jpg")
    with pytest.raises(UserError, match="no column 'image'.*--image-column"):
        open_source(str(renamed))
    assert open_source(str(renamed), "hf", image_column="jpg").labels == [0, 0, 1, 1, 2, 2]
    with pytest.raises(UserError):  # an image folder read as tars holds none
        open_source(str(containers["imagefolder"]), "wds")


def _extract(path, vae_dir: Path, out: Path, **kw):
    cfg = ExtractConfig(data_path=str(path), vae=str(vae_dir), out=str(out), image_size=SIZE, shard_size=2,
                        batch_size=3, **kw)
    with one_torch_thread():
        return run_extraction(cfg)


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}


@pytest.mark.slow
def test_tars_on_two_processes_and_resumed_hf_with_workers_give_the_same_shards(containers, vae_dir, tmp_path):
    """A brace pattern of tars read by 2 processes (the command line's main on two gloo ranks forked
    from the test; tests/test_latents.py runs it under torchrun), and a save_to_disk dataset read by
    DataLoader workers over a resumed run, write the shards of one straight run."""
    from helpers import ROOT, run_forked_ranks, script_main

    pattern = str(containers["wds"] / "train-{0000..0001}.tar")
    straight = tmp_path / "straight"
    _extract(pattern, vae_dir, straight)
    run_forked_ranks(script_main(ROOT / "scripts" / "extract_latents.py", "--data-path", pattern, "--format", "wds",
                                 "--vae", str(vae_dir), "--out", str(tmp_path / "two"), "--image-size", str(SIZE),
                                 "--shard-size", "2", "--batch-size", "3"), 2)
    assert _shard_bytes(tmp_path / "two") == _shard_bytes(straight)
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["source"]["path"] == pattern

    hf_straight = tmp_path / "hf_straight"
    _extract(containers["hf"], vae_dir, hf_straight)
    resumed = tmp_path / "hf_resumed"
    first = _extract(containers["hf"], vae_dir, resumed, max_shards=1, num_workers=2)
    assert first.written == [0] and first.manifest is None
    second = _extract(containers["hf"], vae_dir, resumed, num_workers=2)
    assert second.reused == [0] and second.written == [1, 2]
    assert _shard_bytes(resumed) == _shard_bytes(hf_straight)
    # latents equal the tars' (same images), shard by shard
    for name in _shard_bytes(straight):
        if name.endswith(".safetensors"):
            a, b = load_file(straight / name), load_file(resumed / name)
            assert all(torch.equal(a[k], b[k]) for k in ("mean", "std", "label", "index"))


def test_a_skipped_in_memory_image_leaves_the_same_bytes_run_after_run(containers, vae_dir, tmp_path):
    """An unreadable image inside a tar is skipped and reported; the report stored in the shards
    names it without the decoder's object address, so two runs write byte-identical shards."""
    import shutil

    damaged = shutil.copytree(containers["wds"], tmp_path / "wds")
    first = sorted(containers["wds"].glob("*.tar"))[0]
    replace_in_tar(first, damaged / first.name, lambda member: True, b"not an image at all")  # its first image
    runs = [_extract(damaged, vae_dir, tmp_path / f"out{k}") for k in range(2)]
    assert all(json.loads(r.manifest.read_text())["num_skipped"] == 1 for r in runs)
    assert _shard_bytes(tmp_path / "out0") == _shard_bytes(tmp_path / "out1")
    from ancre_dit.data.latent_shards import REPORT_NAME

    report = (tmp_path / "out0" / REPORT_NAME).read_text()
    assert "unreadable" in report and " at 0x" not in report and "(in-memory bytes)" in report
