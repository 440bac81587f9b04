"""Any diffusers VAE (AutoencoderKL with 16 channels, AutoencoderDC), the per-channel latent statistics
of extraction and data.latent_norm=channel through training, checkpoint and sampling."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from containers import make_image_folder
from helpers import ROOT, accelerate_state, load_script, one_torch_thread, tiny_config
from safetensors.torch import load_file

from ancre_dit.data.image_folder import load_rgb
from ancre_dit.data.latent_norm import ChannelNorm, latent_norm_from_manifest
from ancre_dit.latents.extract import ExtractConfig, run_extraction
from ancre_dit.vae import decode_to_uint8, load_run_vae, load_vae, to_vae_input

SIZE = 16


def kl16(path: Path) -> Path:
    """A tiny random AutoencoderKL with 16 latent channels, 4x down, SD3-style scale and shift."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
                  latent_channels=16, norm_num_groups=8, sample_size=16, scaling_factor=1.5,
                  shift_factor=0.1).save_pretrained(path)
    return path


def dc(path: Path) -> Path:
    """A tiny random AutoencoderDC (DC-AE: deterministic), 8 channels, 4x down."""
    from diffusers import AutoencoderDC

    torch.manual_seed(0)
    AutoencoderDC(latent_channels=8, encoder_block_types="ResBlock", decoder_block_types="ResBlock",
                  encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
                  encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
                  encoder_qkv_multiscales=((), (), ()), decoder_qkv_multiscales=((), (), ()),
                  scaling_factor=0.5).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("img") / "folder")


def _extract(images: Path, vae: Path, out: Path) -> dict:
    with one_torch_thread():
        run_extraction(ExtractConfig(data_path=str(images), vae=str(vae), out=str(out), image_size=SIZE,
                                     shard_size=4, batch_size=3))
    return json.loads((out / "manifest.json").read_text())


def _moments(out: Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [load_file(out / f"shard-{k:05d}.safetensors") for k in range(n)]
    return torch.cat([p["mean"] for p in parts]).double(), torch.cat([p["std"] for p in parts]).double()


@pytest.fixture(scope="module")
def kl_latents(tmp_path_factory, images) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kl16")
    vae = kl16(root / "vae")
    _extract(images, vae, root / "latents")
    return vae, root / "latents"


def test_kl16_latents_shifted_scaled_with_channel_statistics(kl_latents, images):
    vae_dir, out = kl_latents
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["latent_shape"] == [16, 4, 4]
    assert (manifest["scaling_factor"], manifest["shift_factor"]) == (1.5, 0.1)  # from the VAE's config
    mean, std = _moments(out, 2)
    # The statistics of the posterior draws mean + std * eps, over images, flips and positions.
    mu = mean.mean(dim=(0, 1, 3, 4))
    var = mean.var(dim=(0, 1, 3, 4), unbiased=False) + (std ** 2).mean(dim=(0, 1, 3, 4))
    assert np.allclose(manifest["channel_mean"], mu.numpy(), rtol=1e-10, atol=1e-12)
    assert np.allclose(manifest["channel_std"], var.sqrt().numpy(), rtol=1e-10)
    # ... and a Monte Carlo of such draws agrees.
    g = torch.Generator().manual_seed(0)
    draws = mean + std * torch.randn(mean.shape, generator=g, dtype=torch.float64)
    assert np.allclose(draws.std(dim=(0, 1, 3, 4)).numpy(), manifest["channel_std"], rtol=0.1)
    # Stored = (posterior mean - shift) * scale of the crop, computed directly.
    vae = load_vae(str(vae_dir), "cpu").vae
    crop = torch.from_numpy(np.array(load_rgb(images / "ant" / "0.jpg", SIZE)))[None]
    with torch.no_grad():
        direct = (vae.encode(to_vae_input(crop)).latent_dist.mean - 0.1) * 1.5
    assert torch.allclose(mean[0, 0].float(), direct[0], atol=2e-3)


def test_autoencoder_dc_latents(tmp_path, images):
    vae_dir = dc(tmp_path / "dc")
    manifest = _extract(images, vae_dir, tmp_path / "latents")
    assert manifest["latent_shape"] == [8, 4, 4] and manifest["vae"] == str(vae_dir)
    mean, std = _moments(tmp_path / "latents", 2)
    assert float(std.abs().max()) == 0.0  # deterministic encoder
    vae = load_vae(str(vae_dir), "cpu").vae
    crop = torch.from_numpy(np.array(load_rgb(images / "ant" / "0.jpg", SIZE)))[None]
    with torch.no_grad():
        direct = vae.encode(to_vae_input(crop)).latent * 0.5
    assert torch.allclose(mean[0, 0].float(), direct[0], atol=2e-3)
    assert np.allclose(manifest["channel_std"], mean.std(dim=(0, 1, 3, 4), unbiased=False).numpy(), rtol=1e-10)


def test_channel_norm_round_trip_and_decoding_inverts_it(kl_latents):
    vae_dir, out = kl_latents
    manifest = json.loads((out / "manifest.json").read_text())
    norm = latent_norm_from_manifest("channel", manifest, "here")
    assert latent_norm_from_manifest("scale", manifest, "here") is None
    mean, _ = _moments(out, 2)
    z = mean.flatten(0, 1).float()  # every image and its flip
    x = norm(z)
    assert torch.allclose(norm.invert(x), z, atol=1e-5)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(16), atol=1e-4)  # std spans the draws: not 1 here
    spec = {"kind": "latents", "vae": str(vae_dir), "scaling_factor": 1.5}
    plain = decode_to_uint8(load_run_vae(spec, 16), z)
    inverted = decode_to_uint8(load_run_vae({**spec, **norm.spec()}, 16), x)
    assert np.abs(plain.astype(int) - inverted.astype(int)).max() <= 1
    assert isinstance(norm, ChannelNorm) and norm.spec()["channel_mean"] == pytest.approx(manifest["channel_mean"])


@pytest.mark.slow
def test_16_channel_latents_train_and_sample_with_channel_norm(kl_latents, tmp_path):
    """16-channel latents, data.latent_norm=channel: trains (with sample grids through the VAE), the
    checkpoint carries the statistics, and sample.py decodes without the latent folder."""
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.sampling.api import sample_latents
    from ancre_dit.sampling.guidance import Guidance
    from ancre_dit.training import train

    vae_dir, out = kl_latents
    latents = shutil.copytree(out, tmp_path / "latents")
    run = tmp_path / "run"
    with accelerate_state():
        train(tiny_config(run, "data.kind=latents", f"data.path={latents}", f"data.image_size={SIZE}",
                          "data.latent_norm=channel", "train.max_steps=3", "train.global_batch_size=4",
                          "train.ckpt_every=3", "train.sample_every=3"))
    manifest = json.loads((latents / "manifest.json").read_text())
    model, spec = load_trained_model(run / "checkpoints" / "0000003", "ema")
    assert (model.in_channels, model.input_size) == (16, 4)
    assert spec["data"]["latent_norm"] == "channel"
    assert spec["data"]["channel_mean"] == pytest.approx(manifest["channel_mean"])
    assert spec["data"]["channel_std"] == pytest.approx(manifest["channel_std"])
    assert (run / "samples" / "0000003.png").is_file()  # the grid decoded through the inverse
    shutil.rmtree(latents)  # sampling needs the checkpoint and the VAE only
    npz = tmp_path / "s.npz"
    load_script(ROOT / "sample.py").main(["--ckpt", str(run / "checkpoints" / "0000003"), "--num-samples", "2",
                                          "--steps", "3", "--sampler", "ddim", "--classes", "0,2", "--seed", "1",
                                          "--out", str(npz)])
    with np.load(npz) as f:
        got = f["arr_0"]
    assert got.shape == (2, SIZE, SIZE, 3) and got.dtype == np.uint8
    # The same as sampling by hand, un-normalising per channel, then the VAE's scale and shift.
    z = sample_latents(model, spec["diffusion"], [0, 2], seed=1, steps=3, sampler="ddim", guidance=Guidance(1.5))
    norm = ChannelNorm(spec["data"]["channel_mean"], spec["data"]["channel_std"])
    vae = load_vae(str(vae_dir), "cpu").vae
    with torch.no_grad():
        pixels = vae.decode(norm.invert(z) / 1.5 + 0.1).sample
    expected = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1
