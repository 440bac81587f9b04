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


FLOW = dict(objective="flow", path="linear", prediction="velocity", time_sampling="uniform", logit_mean=0.0,
            logit_std=1.0, learn_sigma=False)


def _ckpt(folder: Path, channels: int, diffusion: dict = DIFFUSION) -> Path:
    """A tiny random pixel-space DiT (channels >= 3 so DiT's 3-channel guidance applies)."""
    torch.manual_seed(0)
    kwargs = {**TINY_DIT, "in_channels": channels, "learn_sigma": diffusion["learn_sigma"]}
    model = create_model("DiT-T/2", **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    data = dict(kind="images" if channels == 3 else "digits", image_size=8, image_channels=channels, num_classes=10,
                vae=None, scaling_factor=None)
    write_model_files(folder, make_model_spec(TINY_NAME, kwargs, diffusion, data, step=7), model.state_dict(),
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


# Each source's sampling script, read off its code: the values its headline number was drawn with.
SOURCES = {
    # SiT sample_ddp.py SDE: num_sampling_steps 250 (time points, as our sde counts them), last_step
    # Mean over last_step_size 0.04, diffusion_norm 1; forward_with_cfg guides channels :3; cfg 1.5.
    "sit": {"sampler": "sde", "steps": 250, "sde_last_step": "mean", "sde_last_step_size": 0.04,
            "sde_diffusion_norm": 1.0, "cfg_channels": 3, "guidance_interval": None, "cfg_scale": 1.5},
    # REPA README: --mode sde --num_steps 250 --cfg-scale 1.8 --guidance_high 0.7; samplers.py guides
    # all channels while t_cur <= guidance_high on a time axis with 0 = data, 1 = noise.
    "repa": {"sampler": "sde", "steps": 250, "sde_last_step": "mean", "sde_last_step_size": 0.04,
             "sde_diffusion_norm": 1.0, "cfg_channels": None, "guidance_interval": (0.0, 0.7), "cfg_scale": 1.8},
    # LightningDiT configs/reproductions/*800ep_cfg.yaml: euler, num_sampling_steps 250 time points
    # (linspace(0, 1, 250): 249 steps), timestep_shift 0.3, cfg_interval_start 0.125 on SiT's time
    # (t >= 0.125 is guided: u = 1 - t <= 0.875), cfg_scale 6.7; forward_with_cfg guides channels :3.
    "lightningdit": {"sampler": "euler", "steps": 250 - 1, "time_shift": 0.3, "cfg_channels": 3,
                     "guidance_interval": (0.0, 1 - 0.125), "cfg_scale": 6.7},
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_flow_protocol_is_its_sources_sampling(name):
    from ancre_dit.sampling.protocols import PROTOCOLS

    p = PROTOCOLS[name]
    wanted = dict(SOURCES[name])
    assert p.cfg_scale == wanted.pop("cfg_scale")
    assert {k: p.settings[k] for k in wanted} == wanted
    assert p.objective == "flow" and p.settings["label_mode"] == "random" and p.settings["precision"] == "fp32"


@pytest.mark.slow
def test_a_flow_protocol_samples_as_its_settings_spelled_out(tmp_path, capsys):
    ckpt = _ckpt(tmp_path / "ckpt", channels=3, diffusion=FLOW)
    common = ["--ckpt", str(ckpt), "--num-samples", "3", "--batch-size", "3", "--seed", "2", "--steps", "4"]
    with pytest.raises(UserError, match=r"--protocol lightningdit samples with steps 249, but --steps asks for 4"):
        _sample(*common, "--protocol", "lightningdit", "--out", str(tmp_path / "l.npz"))
    _sample(*common[:-2], "--protocol", "repa", "--out", str(tmp_path / "r.npz"))
    assert "cfg scale 1.8 unless --cfg-scale is given" in capsys.readouterr().out
    record = read_sampling_record(tmp_path / "r.npz")
    assert record["cfg_scale"] == 1.8 and record["guidance_interval"] == [0.0, 0.7] and record["cfg_channels"] is None
    _sample(*common[:-2], "--sampler", "sde", "--steps", "250", "--random-classes", "--cfg-scale", "1.8",
            "--guidance-interval", "0,0.7", "--out", str(tmp_path / "flags.npz"))
    assert np.array_equal(_npz(tmp_path / "flags.npz")[0], _npz(tmp_path / "r.npz")[0])
    # The LightningDiT protocol spelled out, likewise (its shift and 3-channel guidance included).
    _sample(*common[:-2], "--protocol", "lightningdit", "--out", str(tmp_path / "l.npz"))
    _sample(*common[:-2], "--sampler", "euler", "--steps", "249", "--time-shift", "0.3", "--cfg-channels", "3",
            "--random-classes", "--cfg-scale", "6.7", "--guidance-interval", "0,0.875", "--out", str(tmp_path / "lf.npz"))
    assert np.array_equal(_npz(tmp_path / "lf.npz")[0], _npz(tmp_path / "l.npz")[0])
    assert read_sampling_record(tmp_path / "l.npz")["time_shift"] == 0.3
    # A ddpm protocol on a flow checkpoint names the ones that fit.
    with pytest.raises(UserError, match=r"drop --protocol or choose one for flow \(sit, repa, lightningdit\)"):
        _sample("--ckpt", str(ckpt), "--protocol", "dit", "--out", str(tmp_path / "d.npz"))


def test_the_guidance_intervals_are_the_sources_rules():
    """REPA guides while its t <= 0.7 (its t: 1 = noise); LightningDiT while SiT's t >= 0.125."""
    from ancre_dit.diffusion import FlowObjective
    from ancre_dit.sampling.guidance import Guidance
    from ancre_dit.sampling.protocols import PROTOCOLS

    flow = FlowObjective()
    for t in np.linspace(0, 1, 41):  # our flow time: 0 = noise, 1 = data
        u = flow.normalized_time(float(t))
        repa = Guidance(1.8, interval=PROTOCOLS["repa"].settings["guidance_interval"])
        lightningdit = Guidance(6.7, interval=PROTOCOLS["lightningdit"].settings["guidance_interval"])
        assert repa.active_at(u) == (1 - t <= 0.7 + 1e-12)
        assert lightningdit.active_at(u) == (t >= 0.125 - 1e-12)
