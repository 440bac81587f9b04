"""The whole latent pipeline end to end, small: an image folder -> VAE latent shards ->
training on them -> a checkpoint -> sample.py decoding through the same VAE into an ADM npz."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT, accelerate_state, load_script, tiny_config, tiny_vae
from PIL import Image

from ancre_dit.data.adm_npz import load_adm_npz
from ancre_dit.data.latent_shards import LatentShardDataset
from ancre_dit.latents.extract import ExtractConfig, run_extraction
from ancre_dit.checkpoint import load_trained_model
from ancre_dit.training import train


@pytest.fixture
def vae_and_images(tmp_path):
    tiny_vae(tmp_path / "vae")
    rng = np.random.default_rng(0)
    for name in ("apple", "pear"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / name / f"{i}.png")
    return tmp_path / "vae", tmp_path / "images"


@pytest.mark.slow
def test_images_to_latents_to_training_to_samples(tmp_path, vae_and_images):
    vae, images = vae_and_images
    latents = tmp_path / "latents"
    run_extraction(ExtractConfig(data_path=str(images), vae=str(vae), out=str(latents), image_size=16,
                                 shard_size=4, batch_size=4))
    data = LatentShardDataset(latents)
    assert len(data) == 8 and data.num_classes == 2 and tuple(data.latent_shape) == (4, 8, 8)

    run = tmp_path / "run"
    with accelerate_state():
        out = train(tiny_config(run, "data.kind=latents", f"data.path={latents}", "data.image_size=16",
                                "train.max_steps=3", "train.global_batch_size=4", "train.ckpt_every=3",
                                "train.sample_every=3", "train.num_sample_images=2"))
    assert out["step"] == 3
    assert (run / "samples" / "0000003.png").is_file()  # the grid decoded through the run's VAE
    ckpt = run / "checkpoints" / "0000003"
    model, spec = load_trained_model(ckpt)
    assert (model.in_channels, model.input_size, model.num_classes) == (4, 8, 2)
    assert spec["data"]["vae"] == str(vae) and spec["data"]["scaling_factor"] == pytest.approx(0.18215)

    sample_script = load_script(ROOT / "sample.py")
    npz = tmp_path / "samples.npz"
    assert sample_script.main(["--ckpt", str(ckpt), "--num-samples", "3", "--steps", "4", "--cfg-scale", "2",
                               "--out", str(npz), "--cpu"]) in (0, None)
    batch = load_adm_npz(npz)
    assert batch.images.shape == (3, 16, 16, 3) and batch.images.dtype == np.uint8
    assert batch.labels.tolist() == [0, 1, 0]
