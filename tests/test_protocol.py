"""The paper's evaluation protocol: `sample.py --protocol dit` sets exactly random labels,
DDPM-250, guidance on the first 3 channels and fp32; contradicting flags are refused; the sampling
settings travel next to the npz and into evaluate.py's JSON."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import create_model
from ancre_dit.sampling import assign_labels
from ancre_dit.sampling.protocols import read_sampling_record, record_path
from ancre_dit.checkpoint import make_model_spec, write_model_files
from helpers import ROOT, TINY_DIT, TINY_NAME, load_script

REPO = ROOT
DIFFUSION = dict(objective="ddpm", num_timesteps=1000, beta_start=1e-4, beta_end=0.02, learn_sigma=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def _ckpt(folder: Path, channels: int) -> Path:
    """A tiny random pixel-space DiT (channels >= 3 so DiT's 3-channel guidance applies)."""
    torch.manual_seed(0)
    kwargs = {**TINY_DIT, "in_channels": channels, "learn_sigma": True}
    model = create_model("DiT-T/2", **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    data = dict(kind="images" if channels == 3 else "digits", image_size=8, image_channels=channels, num_classes=10,
                vae=None, scaling_factor=None)
    write_model_files(folder, make_model_spec(TINY_NAME, kwargs, DIFFUSION, data, step=7), model.state_dict(),
                      model.state_dict())
    return folder


def _sample(*args: str) -> None:
    load_script(REPO / "sample.py").main(list(args))


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path) as f:
        return f["arr_0"].copy(), f["arr_1"].copy()


@pytest.mark.slow
def test_protocol_dit_sets_exactly_the_papers_choices(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt", channels=3)
    common = ["--ckpt", str(ckpt), "--num-samples", "6", "--batch-size", "6", "--cfg-scale", "1.5", "--seed", "3"]
    _sample(*common, "--protocol", "dit", "--out", str(tmp_path / "dit.npz"))
    images, labels = _npz(tmp_path / "dit.npz")
    assert labels.tolist() == assign_labels(np.arange(6), 10, seed=3, mode="random").tolist() != list(range(6))
    record = read_sampling_record(tmp_path / "dit.npz")
    assert record_path(tmp_path / "dit.npz").name == "dit.sampling.json"
    assert {k: record[k] for k in ("protocol", "sampler", "steps", "cfg_channels", "label_mode", "precision",
                                   "guidance_interval", "cfg_scale", "num_samples", "seed")} == {
        "protocol": "dit", "sampler": "ddpm", "steps": 250, "cfg_channels": 3, "label_mode": "random",
        "precision": "fp32", "guidance_interval": None, "cfg_scale": 1.5, "num_samples": 6, "seed": 3}
    # The same choices spelled out flag by flag give the same images (guiding 3 of 4 latent channels
    # rather than all is covered by test_sampling's three-channel test).
    _sample(*common, "--random-classes", "--cfg-channels", "3", "--steps", "250", "--sampler", "ddpm",
            "--out", str(tmp_path / "flags.npz"))
    assert np.array_equal(_npz(tmp_path / "flags.npz")[0], images)
    assert read_sampling_record(tmp_path / "flags.npz")["protocol"] is None


@pytest.mark.parametrize("flags, named", [
    (["--steps", "50"], "--steps"), (["--cfg-channels", "2"], "--cfg-channels"), (["--classes", "1,2"], "--classes"),
    (["--precision", "bf16"], "--precision"), (["--sampler", "ddim"], "--sampler"),
    (["--guidance-interval", "0,500"], "--guidance-interval")])
def test_flags_that_contradict_the_protocol_are_refused(tmp_path, flags, named):
    ckpt = _ckpt(tmp_path / "ckpt", channels=3)
    with pytest.raises(UserError, match=named):
        _sample("--ckpt", str(ckpt), "--protocol", "dit", *flags, "--out", str(tmp_path / "x.npz"))
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.slow
def test_evaluate_json_records_the_sampling_settings(tmp_path, monkeypatch, capsys):
    ckpt = _ckpt(tmp_path / "ckpt", channels=1)
    samples = tmp_path / "s.npz"
    _sample("--ckpt", str(ckpt), "--num-samples", "10", "--steps", "3", "--sampler", "ddim", "--cfg-scale", "2",
            "--out", str(samples))
    main = runpy.run_path(str(REPO / "evaluate.py"))["main"]
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--samples", str(samples), "--digits", "--json",
                                      str(tmp_path / "eval.json")])
    with pytest.raises(SystemExit) as exit_:
        run_cli(main)
    assert exit_.value.code == 0, capsys.readouterr().err
    sampling = json.loads((tmp_path / "eval.json").read_text())["sampling"]
    assert sampling == read_sampling_record(samples)
    assert sampling["sampler"] == "ddim" and sampling["steps"] == 3 and sampling["cfg_scale"] == 2.0
    assert sampling["label_mode"] == "balanced" and sampling["protocol"] is None
    assert sampling["ckpt"] == str(ckpt.resolve()) and sampling["step"] == 7
    # Samples from elsewhere have no record: the JSON says so (null) instead of guessing.
    samples.rename(tmp_path / "other.npz")
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--samples", str(tmp_path / "other.npz"), "--digits", "--json",
                                      str(tmp_path / "eval2.json")])
    with pytest.raises(SystemExit):
        run_cli(main)
    assert json.loads((tmp_path / "eval2.json").read_text())["sampling"] is None
