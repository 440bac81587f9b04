"""Latent extraction: a generated image folder + a tiny random AutoencoderKL.

The reference extraction runs in this process with one torch thread: torchrun gives each of its
processes OMP_NUM_THREADS=1, and CPU convolutions round differently with other thread counts, so
equal thread counts are what makes the 1- vs 2-process comparison byte for byte.
"""
from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, load_script, one_torch_thread, subprocess_env
from PIL import Image
from safetensors.torch import load_file

from ancre_dit.errors import UserError
from ancre_dit.data.image_folder import center_crop_arr, load_and_crop
from ancre_dit.data.latent_shards import LatentShardDataset, draw_latents_from_moments
from ancre_dit.latents.extract import ExtractConfig, run_extraction
from ancre_dit.vae import load_vae

SCRIPT = ROOT / "scripts" / "extract_latents.py"
SIZE, SHARD, BATCH = 32, 4, 3  # 3 per batch: a shard of 4 gives batches of 3 + 1


def _load_script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=32)
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    """3 classes, odd sizes; plus a corrupt file, a truncated JPEG, grayscale, CMYK, palette and tiny images."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c, name in enumerate(["ant", "bee", "cat"]):
        (root / name).mkdir()
        for i in range(3):
            h, w = rng.integers(33, 97, size=2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i}.jpg", quality=90)
    Image.fromarray(rng.integers(0, 256, (41, 57), dtype=np.uint8)).save(root / "ant" / "gray.png")
    (root / "bee" / "corrupt.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    good = (root / "bee" / "0.jpg").read_bytes()
    (root / "bee" / "truncated.jpeg").write_bytes(good[: len(good) // 2])
    rgb = rng.integers(0, 256, (45, 35, 3), dtype=np.uint8)
    Image.fromarray(rgb).convert("CMYK").save(root / "cat" / "cmyk.jpg")
    Image.fromarray(rgb).convert("P").save(root / "cat" / "palette.png")
    Image.fromarray(rgb[:5, :5]).save(root / "cat" / "tiny.png")
    (root / "cat" / "notes.txt").write_text("not an image: ignored like ImageFolder does")
    return root


def _config(image_dir: Path, vae_dir: Path, out: Path, **kw) -> ExtractConfig:
    return ExtractConfig(data_path=str(image_dir), vae=str(vae_dir), out=str(out), image_size=SIZE,
                         shard_size=SHARD, batch_size=BATCH, **kw)


def _extract_one_thread(cfg: ExtractConfig):
    with one_torch_thread():
        return run_extraction(cfg)


@pytest.fixture(scope="module")
def reference(image_dir, vae_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    result = _extract_one_thread(_config(image_dir, vae_dir, out))
    assert result.manifest == out / "manifest.json"
    return out


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


def test_manifest_report_and_labels(reference, image_dir):
    manifest = json.loads((reference / "manifest.json").read_text())
    # 15 files: corrupt, truncated and tiny are skipped; gray, CMYK and palette are converted.
    assert manifest["num_files"] == 15 and manifest["num_images"] == 12 and manifest["num_skipped"] == 3
    assert manifest["num_shards"] == 4 and manifest["latent_shape"] == [4, 16, 16]
    assert manifest["class_names"] == ["ant", "bee", "cat"] and manifest["num_classes"] == 3
    assert manifest["scaling_factor"] == pytest.approx(0.18215) and manifest["dtype"] == "float16"
    assert manifest["image_size"] == SIZE and manifest["vae"] == manifest["extraction"]["vae"]
    rows = [line.split("\t") for line in (reference / manifest["report"]).read_text().splitlines()[1:]]
    report = {path: (action, detail) for _, path, action, detail in rows}
    assert report["ant/gray.png"] == ("converted", "L -> RGB")
    assert report["cat/cmyk.jpg"] == ("converted", "CMYK -> RGB")
    assert report["cat/palette.png"] == ("converted", "P -> RGB")
    assert report["bee/corrupt.jpg"][0] == "skipped" and "unreadable" in report["bee/corrupt.jpg"][1]
    assert report["bee/truncated.jpeg"][0] == "skipped"
    assert report["cat/tiny.png"][0] == "skipped" and "too small" in report["cat/tiny.png"][1]
    # ImageFolder order: sorted classes, sorted files; index = position in that list.
    files = [(f"{c}/{f}", y) for y, c in enumerate(["ant", "bee", "cat"])
             for f in sorted(os.listdir(image_dir / c)) if not f.endswith(".txt")]
    skipped = {i for i, (p, _) in enumerate(files) if report.get(p, ("",))[0] == "skipped"}
    index, labels = [], []
    for k, entry in enumerate(manifest["shards"]):
        shard = load_file(reference / entry["file"])
        assert entry["count"] == len(shard["label"]) and shard["mean"].shape == (entry["count"], 2, 4, 16, 16)
        assert shard["mean"].dtype == shard["std"].dtype == torch.float16 and bool((shard["std"] > 0).all())
        assert all(k * SHARD <= i < (k + 1) * SHARD for i in shard["index"].tolist())
        index += shard["index"].tolist()
        labels += shard["label"].tolist()
    assert index == [i for i in range(len(files)) if i not in skipped]
    assert labels == [files[i][1] for i in index]


@pytest.mark.slow
def test_two_processes_give_identical_shards(reference, image_dir, vae_dir, tmp_path):
    out = tmp_path / "two"
    env = subprocess_env()  # this checkout's code, one thread, CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--data-path", str(image_dir), "--vae", str(vae_dir), "--out", str(out), "--image-size", str(SIZE),
           "--shard-size", str(SHARD), "--batch-size", str(BATCH)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es); process 0: 2 to write" in proc.stdout  # shards 0 and 2 on rank 0, 1 and 3 on rank 1
    _same_files(reference, out)  # every shard, checksum file, the manifest and the report, byte for byte


def test_resume_after_kill_equals_uninterrupted_run(reference, image_dir, vae_dir, tmp_path):
    out = tmp_path / "resumed"
    first = _extract_one_thread(_config(image_dir, vae_dir, out, max_shards=2))
    assert first.written == [0, 1] and first.manifest is None and not (out / "manifest.json").exists()
    # What a kill leaves behind: a temporary file mid-write, and a shard written but not yet checksummed.
    (out / "shard-00003.safetensors.tmp4242").write_bytes(b"half a shard")
    (out / "shard-00000.safetensors.sha256.tmp4242").write_bytes(b"half a checksum")
    shutil.copy(reference / "shard-00002.safetensors", out / "shard-00002.safetensors")
    with open(out / "shard-00002.safetensors", "r+b") as f:
        f.truncate(1000)
    second = _extract_one_thread(_config(image_dir, vae_dir, out))
    assert second.reused == [0, 1] and second.written == [2, 3]
    _same_files(reference, out)
    # A shard whose bytes no longer match its checksum is rewritten by a rerun too.
    with open(out / "shard-00001.safetensors", "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03\x04")
    third = _extract_one_thread(_config(image_dir, vae_dir, out))
    assert third.written == [1] and third.reused == [0, 2, 3]
    _same_files(reference, out)


def test_stored_latents_are_scaled_encodings_of_crop_and_flip(reference, image_dir, vae_dir):
    manifest = json.loads((reference / "manifest.json").read_text())
    vae = load_vae(str(vae_dir), "cpu").vae
    files = sorted((image_dir / "ant").iterdir()) + sorted((image_dir / "bee").iterdir())
    shard0 = load_file(reference / "shard-00000.safetensors")
    checked = 0
    for row, position in enumerate(shard0["index"].tolist()):
        with Image.open(files[position]) as img:
            crop = np.asarray(center_crop_arr(img.convert("RGB"), SIZE))
        views = np.stack([crop, crop[:, ::-1]])  # the image, and flipped AFTER the crop (as DiT does)
        x = torch.from_numpy(views.copy()).permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            posterior = vae.encode(x).latent_dist
        mean, std = posterior.mean * 0.18215, posterior.std * 0.18215
        for view in (0, 1):
            torch.testing.assert_close(shard0["mean"][row, view].float(), mean[view], atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(shard0["std"][row, view].float(), std[view], atol=2e-5, rtol=2e-3)
        assert (mean[0] - mean[1]).abs().max() > 0.05  # the flip view really is a different latent
        checked += 1
    assert checked == SHARD and manifest["shards"][0]["count"] == SHARD  # includes ant/gray.png (converted)


def test_adm_crop_on_a_hand_computed_image(tmp_path):
    # 16x8 image of 4x4 blocks, each with a +-3 checkerboard that a 2x2 box filter averages out:
    # two box halvings (16x8 -> 8x4 -> 4x2) leave the block colours, bicubic at scale 1 is a no-op,
    # and the centre crop to 2x2 takes columns 1..2. Hand-computed answer: blocks [r][1..2].
    base = np.array([[[10, 200, 100], [50, 170, 107], [90, 140, 114], [130, 110, 121]],
                     [[30, 150, 103], [70, 120, 110], [110, 90, 117], [150, 60, 124]]], dtype=np.int16)
    img = np.repeat(np.repeat(base, 4, axis=0), 4, axis=1)
    yy, xx = np.mgrid[:8, :16]
    img = (img + np.where((yy + xx) % 2 == 0, 3, -3)[..., None]).astype(np.uint8)
    Image.fromarray(img).save(tmp_path / "blocks.png")
    array, action, _ = load_and_crop(tmp_path / "blocks.png", 2, min_side=1)
    assert action == "ok"
    np.testing.assert_array_equal(array, base[:, 1:3].astype(np.uint8))
    # Up-scaling a 5x3 constant image to 4x4 (bicubic) keeps the constant; palette input converts.
    Image.fromarray(np.full((3, 5, 3), (10, 20, 30), np.uint8)).convert("P", palette=Image.ADAPTIVE).save(tmp_path / "flat.png")
    array, action, detail = load_and_crop(tmp_path / "flat.png", 4, min_side=1)
    assert (action, detail) == ("converted", "P -> RGB")
    np.testing.assert_array_equal(array, np.full((4, 4, 3), (10, 20, 30), np.uint8))


def test_verify_names_each_corrupt_or_missing_shard(reference, tmp_path, capsys):
    main = _load_script().main
    assert main(["--verify", str(reference)]) == 0
    assert "all checksums and shapes OK" in capsys.readouterr().out
    bad = tmp_path / "bad"
    shutil.copytree(reference, bad)
    with open(bad / "shard-00001.safetensors", "r+b") as f:  # one byte in the tensor data
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    (bad / "shard-00003.safetensors").unlink()
    assert main(["--verify", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["shard-00001.safetensors: corrupt: checksum mismatch (file changed or corrupt)",
                     "shard-00003.safetensors: missing"]
    (bad / "manifest.json").unlink()
    with pytest.raises(ValueError, match="extract_latents.py"):
        main(["--verify", str(bad)])


def test_dataset_reads_shards_and_draw_latents_from_moments_uses_the_generator(reference):
    ds = LatentShardDataset(reference)
    assert len(ds) == 12 and ds.num_classes == 3 and ds.latent_shape == (4, 16, 16)
    shards = [load_file(reference / s["file"]) for s in ds.manifest["shards"]]
    mean = torch.cat([s["mean"] for s in shards])
    std = torch.cat([s["std"] for s in shards])
    labels = torch.cat([s["label"] for s in shards]).tolist()
    for i in [0, 3, 4, 7, 11, -1]:
        moments, label = ds[i]
        assert moments.dtype == torch.float16 and moments.shape == (2, 2, 4, 16, 16)
        assert torch.equal(moments[:, 0], mean[i]) and torch.equal(moments[:, 1], std[i]) and label == labels[i]
    loader = torch.utils.data.DataLoader(ds, batch_size=5, shuffle=False)
    moments, y = next(iter(loader))
    assert moments.shape == (5, 2, 2, 4, 16, 16) and y.tolist() == labels[:5]
    z1 = draw_latents_from_moments(moments, torch.Generator().manual_seed(7))
    z2 = draw_latents_from_moments(moments, torch.Generator().manual_seed(7))
    assert z1.dtype == torch.float32 and z1.shape == (5, 4, 16, 16) and torch.equal(z1, z2)
    # The contract the trainer's exact resume relies on: flips first, then the noise, from that generator.
    g = torch.Generator().manual_seed(7)
    flip = torch.randint(0, 2, (5,), generator=g)
    eps = torch.randn(5, 4, 16, 16, generator=g)
    chosen = moments[torch.arange(5), flip].float()
    torch.testing.assert_close(z1, chosen[:, 0] + chosen[:, 1] * eps)
    assert not torch.equal(z1, draw_latents_from_moments(moments, torch.Generator().manual_seed(8)))
    with pytest.raises(ValueError, match="extract_latents.py"):
        LatentShardDataset(reference / "nowhere")


def test_user_mistakes_are_one_clear_error(reference, image_dir, vae_dir, tmp_path):
    with pytest.raises(UserError, match="not a folder"):
        load_vae(str(tmp_path / "no" / "vae"), "cpu")
    with pytest.raises(UserError, match="downsampling factor 2"):
        run_extraction(ExtractConfig(str(image_dir), str(vae_dir), str(tmp_path / "o"), image_size=31))
    with pytest.raises(UserError, match="GPU"):
        run_extraction(ExtractConfig(str(image_dir), str(vae_dir), str(tmp_path / "o"), vae_dtype="fp16"))
    with pytest.raises(UserError, match="no class subfolders"):
        run_extraction(ExtractConfig(str(vae_dir), str(vae_dir), str(tmp_path / "o")))
    # Resuming into a folder written with other settings is refused instead of mixing two extractions.
    mixed = tmp_path / "mixed"
    shutil.copytree(reference, mixed)
    with pytest.raises(UserError, match="different extraction"):
        run_extraction(_config(image_dir, vae_dir, mixed, min_side=4))
