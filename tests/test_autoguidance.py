"""Autoguidance (EDM2's): a weaker model of the same task guides, D = D_weak + w (D - D_weak), inside
the guidance interval, on the guided channels; sample.py --guide-ckpt takes a checkpoint folder and
refuses one that does not share the latent space, classes and objective."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT, load_script
from test_sampling import DIFFUSION, DIGITS, TINY, random_model, write_ckpt

from ancre_dit.checkpoint import make_model_spec, write_model_files
from ancre_dit.diffusion import build_objective
from ancre_dit.errors import UserError
from ancre_dit.sampling import GuidedDenoiser, Guidance

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(channels: int = 1):
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, channels, 8, 8, generator=g), torch.full((3,), 400), torch.tensor([1, 2, 3])


def test_the_weak_model_guides_by_the_formula_and_the_variance_stays_the_models():
    model, weak = random_model(seed=0), random_model(seed=1, depth=1)  # a smaller model of the same task
    x, t, y = _inputs()
    with torch.no_grad():
        d, d_weak = model(x, t, y), weak(x, t, y)
    out = GuidedDenoiser(model, Guidance(2.5), guide=weak)(x, t, y)
    expected_eps = d_weak[:, :1] + 2.5 * (d[:, :1] - d_weak[:, :1])
    torch.testing.assert_close(out[:, :1], expected_eps)
    assert torch.equal(out[:, 1:], d[:, 1:])  # the learned variance: the sampled model's own
    assert (out[:, :1] - d[:, :1]).abs().max() > 1e-3


def test_only_the_guided_channels_and_only_inside_the_interval():
    model, weak = random_model(seed=0, in_channels=4), random_model(seed=1, in_channels=4)
    x, _, y = _inputs(channels=4)
    ddpm = build_objective(DIFFUSION)
    denoise = GuidedDenoiser(model, Guidance(3.0, channels=3, interval=(100 / 999, 600 / 999)),
                             normalized_time=ddpm.normalized_time, guide=weak)
    for step, inside in ((50, False), (400, True), (900, False)):
        t = torch.full((3,), step)
        with torch.no_grad():
            d, d_weak = model(x, t, y), weak(x, t, y)
        out = denoise(x, t, y)
        if not inside:
            assert torch.equal(out, d)
            continue
        torch.testing.assert_close(out[:, :3], d_weak[:, :3] + 3.0 * (d[:, :3] - d_weak[:, :3]))
        assert torch.equal(out[:, 3:], d[:, 3:])  # channel 3 and the variance unguided


def test_a_model_without_class_dropout_can_be_autoguided():
    """Autoguidance needs no unconditional mode: both models are conditional."""
    model, weak = random_model(seed=0, class_dropout_prob=0.0), random_model(seed=1, class_dropout_prob=0.0)
    x, t, y = _inputs()
    with pytest.raises(UserError, match="trained without class dropout"):
        GuidedDenoiser(model, Guidance(2.0))
    GuidedDenoiser(model, Guidance(2.0), guide=weak)(x, t, y)


@pytest.mark.parametrize("overrides, named", [({"num_classes": 5}, "num_classes 5"),
                                              ({"in_channels": 4}, "in_channels 4")])
def test_a_guide_of_another_task_is_refused(overrides, named):
    with pytest.raises(UserError, match=f"the guiding model has {named}, the sampled model"):
        GuidedDenoiser(random_model(seed=0), Guidance(2.0), guide=random_model(seed=1, **overrides))


def _run_sample(*args: str) -> None:
    load_script(ROOT / "sample.py").main(list(args))


def test_sample_py_guides_with_a_checkpoint_and_refuses_a_mismatched_one(tmp_path):
    main = write_ckpt(tmp_path / "main", random_model(seed=0), TINY)
    weak = write_ckpt(tmp_path / "weak", random_model(seed=1, depth=1), {**TINY, "depth": 1})
    common = ["--ckpt", str(main), "--num-samples", "4", "--batch-size", "2", "--steps", "5", "--cfg-scale", "2"]
    _run_sample(*common, "--guide-ckpt", str(weak), "--out", str(tmp_path / "auto.npz"))
    _run_sample(*common, "--out", str(tmp_path / "cfg.npz"))
    auto, cfg = np.load(tmp_path / "auto.npz")["arr_0"], np.load(tmp_path / "cfg.npz")["arr_0"]
    assert auto.shape == cfg.shape == (4, 8, 8, 3) and not np.array_equal(auto, cfg)

    # The same images through the Python API with the guide in memory.
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.sampling import sample_images
    from ancre_dit.sampling.api import build_decoder
    model, spec = load_trained_model(main)
    guide, _ = load_trained_model(weak)
    decoder = build_decoder(spec["data"], model.in_channels, None, torch.device("cpu"))
    images = sample_images(model, spec["diffusion"], np.arange(4) % 10, steps=5, guidance=Guidance(2.0), guide=guide,
                           decoder=decoder)
    assert np.array_equal(np.broadcast_to(images, auto.shape), auto)  # the npz holds RGB

    other = tmp_path / "other"  # another objective's schedule: another denoising process
    spec = make_model_spec("DiT-T/2", TINY, {**DIFFUSION, "num_timesteps": 500}, DIGITS, step=3)
    model = random_model(seed=2)
    write_model_files(other, spec, model.state_dict(), model.state_dict())
    with pytest.raises(UserError, match=r"--guide-ckpt .* does not fit --ckpt .*diffusion.num_timesteps 500 there, "
                                        r"1000 here.*same latent space, classes and objective"):
        _run_sample(*common, "--guide-ckpt", str(other), "--out", str(tmp_path / "x.npz"))
    with pytest.raises(UserError, match="--guide-ckpt guides at --cfg-scale w != 1"):
        _run_sample(*common[:-2], "--cfg-scale", "1", "--guide-ckpt", str(weak), "--out", str(tmp_path / "y.npz"))
    with pytest.raises(UserError, match="--protocol dit guides classifier-free; drop --guide-ckpt or drop --protocol"):
        _run_sample("--ckpt", str(main), "--num-samples", "4", "--protocol", "dit", "--guide-ckpt", str(weak),
                    "--out", str(tmp_path / "z.npz"))
    assert not any((tmp_path / f"{name}.npz").exists() for name in "xyz")


@pytest.mark.slow
def test_the_evaluation_during_training_can_autoguide_with_an_earlier_checkpoint(tmp_path):
    from helpers import accelerate_state, tiny_config

    from ancre_dit.training import train
    from ancre_dit.training.run_evaluation import read_evals

    evaluation = ["eval.num_samples=8", "eval.batch_size=8", "eval.steps=3", "eval.cfg_scales=[2.0]",
                  "eval.heldout_loss=false", "train.ckpt_every=2"]
    with accelerate_state():
        train(tiny_config(tmp_path / "run", "train.max_steps=2", *evaluation))
    early = tmp_path / "run/checkpoints/0000002"
    runs = {}
    for name, extra in (("cfg", []), ("auto", [f"eval.guide_ckpt={early}"])):
        with accelerate_state():
            train(tiny_config(tmp_path / name, "train.max_steps=4", "train.eval_every=4", *evaluation, *extra))
        (runs[name],) = read_evals(tmp_path / name)
    assert runs["auto"]["settings"]["guide_ckpt"] == str(early.resolve()) and "guide_ckpt" not in runs["cfg"]["settings"]
    assert runs["auto"]["metrics"] != runs["cfg"]["metrics"]  # the same run's samples, guided otherwise
    with pytest.raises(UserError, match="eval.guide_ckpt .* is no checkpoint folder"):
        tiny_config(tmp_path / "x", f"eval.guide_ckpt={tmp_path}")


def test_flow_sampling_autoguides_too():
    from ancre_dit.sampling import sample_latents

    model, weak = random_model(seed=0, learn_sigma=False), random_model(seed=1, learn_sigma=False, depth=1)
    flow = {"objective": "flow", "learn_sigma": False}
    labels = [1, 2]
    plain = sample_latents(model, flow, labels, steps=3, guidance=Guidance(1.0), guide=weak)  # scale 1: no guidance
    assert torch.equal(plain, sample_latents(model, flow, labels, steps=3, guidance=Guidance(1.0)))
    auto = sample_latents(model, flow, labels, steps=3, guidance=Guidance(2.0), guide=weak)
    cfg = sample_latents(model, flow, labels, steps=3, guidance=Guidance(2.0))
    assert not torch.equal(auto, plain) and not torch.equal(auto, cfg)


def test_a_guide_fits_whatever_only_shapes_training_and_not_another_latent_scale(tmp_path):
    """The cosine loss shapes training, not the denoising process; the scaling factor is compared as
    the resume check compares it (through JSON, to 1e-6 relative)."""
    from ancre_dit.checkpoint import make_model_spec
    from ancre_dit.sampling.job import load_guide

    flow = {"objective": "flow", "learn_sigma": False, "time_sampling": "uniform"}
    latents = {**DIGITS, "kind": "latents", "scaling_factor": 0.18215}
    weak = random_model(seed=1, learn_sigma=False)
    spec = make_model_spec("DiT-T/2", {**TINY, "learn_sigma": False}, {**flow, "cosine_loss_weight": 1.0}, latents, 7)
    write_model_files(tmp_path / "weak", make_model_spec("DiT-T/2", {**TINY, "learn_sigma": False}, flow,
                                                         {**latents, "scaling_factor": 0.18215 * (1 + 1e-9)}, 3),
                      weak.state_dict(), weak.state_dict())
    load_guide(str(tmp_path / "weak"), spec, "cpu", "--guide-ckpt weak", "--ckpt main")
    with pytest.raises(UserError, match=r"--guide-ckpt weak does not fit --ckpt main \(data.scaling_factor 0\.18215\d* "
                                        r"there, 0\.25 here\)"):
        load_guide(str(tmp_path / "weak"), {**spec, "data": {**latents, "scaling_factor": 0.25}}, "cpu",
                   "--guide-ckpt weak", "--ckpt main")
