"""SiT's paths (linear, GVP, VP), predictions (velocity, score, noise) and loss weights, each held to
SiT's formulas written out again here (transport/path.py and transport.py), to exact Gaussian
quantities, and to samplers that recover Gaussian data from the exact network of each kind."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ancre_dit.diffusion import FlowObjective, build_objective
from ancre_dit.diffusion.paths import PATHS
from ancre_dit.errors import UserError
from ancre_dit.sampling import sample_latents

T = torch.linspace(0.02, 0.98, 25, dtype=torch.float64)


def sit_coefficients(name: str, t: torch.Tensor):
    """SiT's compute_alpha_t / compute_sigma_t, as path.py writes them."""
    if name == "linear":  # ICPlan
        return t, torch.ones_like(t), 1 - t, -torch.ones_like(t)
    if name == "gvp":  # GVPCPlan
        return (torch.sin(t * np.pi / 2), np.pi / 2 * torch.cos(t * np.pi / 2), torch.cos(t * np.pi / 2),
                -np.pi / 2 * torch.sin(t * np.pi / 2))
    sigma_min, sigma_max = 0.1, 20.0  # VPCPlan
    log_mean_coeff = -0.25 * ((1 - t) ** 2) * (sigma_max - sigma_min) - 0.5 * (1 - t) * sigma_min
    d_log_mean_coeff = 0.5 * (1 - t) * (sigma_max - sigma_min) + 0.5 * sigma_min
    alpha = torch.exp(log_mean_coeff)
    p_sigma = 2 * log_mean_coeff
    sigma = torch.sqrt(1 - torch.exp(p_sigma))
    return alpha, alpha * d_log_mean_coeff, sigma, torch.exp(p_sigma) * (2 * d_log_mean_coeff) / (-2 * sigma)


def sit_drift(name: str, t: torch.Tensor):
    """SiT's compute_drift as (a, b) of a x + b score: ICPlan (alpha'/alpha, ratio sigma^2 - sigma sigma'), VP beta/2."""
    if name == "vp":
        beta = 0.1 + (1 - t) * (20.0 - 0.1)
        return beta / 2, beta / 2
    alpha, d_alpha, sigma, d_sigma = sit_coefficients(name, t)
    ratio = d_alpha / alpha
    return ratio, ratio * sigma ** 2 - sigma * d_sigma


@pytest.mark.parametrize("name", ["linear", "gvp", "vp"])
def test_paths_are_sits_and_their_derivatives_are_derivatives(name):
    path = PATHS[name]
    ours, theirs = path.coefficients(T), sit_coefficients(name, T)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    for a, b in zip(path.drift_terms(T), sit_drift(name, T)):
        torch.testing.assert_close(a, b)
    h = 1e-6  # alpha' and sigma' are the derivatives of alpha and sigma
    up, down = path.coefficients(T + h), path.coefficients(T - h)
    torch.testing.assert_close(ours[1], (up[0] - down[0]) / (2 * h), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[3], (up[2] - down[2]) / (2 * h), rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours[0][-1:], torch.tensor([1.0], dtype=torch.float64), atol=0.1)  # t = 1 is data


MU, S = 0.5, 0.5  # data N(+-MU, S^2) per dimension (class 1: +MU, class 0: -MU)


def exact(name: str, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor):
    """The exact score of x_t, the velocity E[u | x_t] and the noise E[x0 | x_t] for Gaussian data:
    x_t ~ N(alpha mu, alpha^2 S^2 + sigma^2)."""
    t = t.double().reshape(-1, 1, 1, 1)
    alpha, d_alpha, sigma, d_sigma = sit_coefficients(name, t)
    mu = MU * (2 * y.double() - 1).reshape(-1, 1, 1, 1)
    var = alpha ** 2 * S ** 2 + sigma ** 2
    centred = x.double() - alpha * mu
    score = -centred / var
    velocity = d_alpha * mu + (d_alpha * alpha * S ** 2 + d_sigma * sigma) / var * centred
    noise = sigma / var * centred
    return score, velocity, noise


class ExactNetwork(torch.nn.Module):
    """Predicts `prediction` exactly on `path` (the network a perfect training would give)."""

    num_classes, in_channels, input_size = 2, 1, 4

    def __init__(self, path: str, prediction: str):
        super().__init__()
        self.path, self.prediction = path, prediction
        self.unused = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, t, y):
        score, velocity, noise = exact(self.path, x, t, y)
        return {"score": score, "velocity": velocity, "noise": noise}[self.prediction].to(x.dtype)


@pytest.mark.parametrize("name", ["linear", "gvp", "vp"])
def test_the_score_of_the_exact_velocity_and_noise_is_the_exact_score(name):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(25, 1, 4, 4, generator=g, dtype=torch.float64), torch.arange(25) % 2
    t = T
    score, velocity, noise = exact(name, x, t, y)
    for prediction, out in (("velocity", velocity), ("noise", noise), ("score", score)):
        objective = FlowObjective(path=name, prediction=prediction)
        torch.testing.assert_close(objective.score(out, x, t), score, rtol=1e-9, atol=1e-9)
        # and the probability-flow drift of any prediction is the exact velocity field
        torch.testing.assert_close(objective.velocity(out, x, t), velocity, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("prediction,weight", [("noise", "none"), ("noise", "velocity"), ("score", "likelihood"),
                                               ("score", "none")])
def test_score_and_noise_losses_are_sits_weighted_errors(prediction, weight):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 4, 4, generator=g), torch.arange(6) % 2
    objective = FlowObjective(path="gvp", prediction=prediction, loss_weight=weight)
    t, noise = objective.draw(x, g)
    assert objective.training_interval == (1e-5, 1 - 1e-5) and bool(((t >= 1e-5) & (t <= 1 - 1e-5)).all())
    net = lambda x_t, t_, y=None: torch.sin(3 * x_t) + t_.reshape(-1, 1, 1, 1)  # noqa: E731 - any network
    terms = objective.losses(net, x, y, (t, noise))
    # SiT's training_losses, written out: xt = alpha x1 + sigma x0; weight from compute_drift's b
    tt = t.double().reshape(-1, 1, 1, 1)
    alpha, _, sigma, _ = sit_coefficients("gvp", tt)
    x_t = (alpha * x.double() + sigma * noise.double()).float()
    out = net(x_t, t).double()
    b = sit_drift("gvp", tt)[1]
    w = {"none": torch.ones_like(b), "velocity": (b / sigma) ** 2, "likelihood": b / sigma ** 2}[weight]
    error = out - noise.double() if prediction == "noise" else out * sigma + noise.double()
    expected = (w * error ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(terms["loss"].double(), expected, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("name,prediction,sampler", [
    ("gvp", "velocity", "heun"), ("gvp", "noise", "heun"), ("vp", "score", "heun"), ("linear", "noise", "euler")])
def test_every_path_and_prediction_samples_the_data_from_its_exact_network(name, prediction, sampler):
    """The ODE from the exact network of each kind, 1000 samples per class of N(+-0.5, 0.25): mean
    within 0.04, variance within 10%."""
    objective = FlowObjective(path=name, prediction=prediction)
    labels = np.arange(2000) % 2
    steps = {"heun": 40, "euler": 100}[sampler]
    x = sample_latents(ExactNetwork(name, prediction), objective.spec(), labels, sampler=sampler, steps=steps, seed=4)
    for c, sign in ((0, -1), (1, 1)):
        values = x[torch.from_numpy(labels) == c].flatten(1).double()
        assert abs(values.mean().item() - sign * MU) < 0.04, (c, values.mean().item())
        assert abs(values.var(dim=0).mean().item() - S ** 2) < 0.1 * S ** 2, values.var(dim=0).mean().item()


@pytest.mark.parametrize("name,prediction,last", [("gvp", "noise", "mean"), ("vp", "velocity", "mean"),
                                                  ("linear", "score", "tweedie"), ("gvp", "velocity", "euler")])
def test_the_sde_is_sits_euler_maruyama_on_every_path(name, prediction, last):
    """SiT's sample_sde written out (Sampler, _SDE, the "sigma" diffusion form, norm 1): time points
    linspace(t0, 1 - 0.04, steps), x += (drift + w score) dt + sqrt(2 w dt) z with w = sigma(t), then the
    last step; t0 = sample_eps for a score or noise model on linear / GVP, else 0."""
    from ancre_dit.diffusion import SDEOptions
    from ancre_dit.sampling.api import SampleNoise

    steps, labels, net = 30, [0, 1, 1], ExactNetwork(name, prediction)
    ours = sample_latents(net, FlowObjective(path=name, prediction=prediction).spec(), labels, sampler="sde",
                          steps=steps, seed=6, sde=SDEOptions(last_step=last))
    noise = SampleNoise(6, [0, 1, 2], (1, 4, 4), torch.device("cpu"))
    x, y = noise.next().double(), torch.tensor(labels)

    def parts(x, t):
        tt = torch.full((3,), t, dtype=torch.float64)
        score, velocity, _ = exact(name, x, tt, y)  # the exact network's output, in any prediction, gives these
        sigma = sit_coefficients(name, tt.reshape(-1, 1, 1, 1))[2]
        return score, velocity, sigma

    t0 = 1e-3 if prediction != "velocity" and name != "vp" else 0.0
    times = torch.linspace(t0, 1 - 0.04, steps)
    dt = float(times[1] - times[0])
    for t in times[:-1].tolist():
        score, velocity, sigma = parts(x, t)
        x = x + (velocity + sigma * score) * dt + torch.sqrt(2 * sigma * dt) * noise.next().double()
    score, velocity, sigma = parts(x, float(times[-1]))
    if last == "mean":
        x = x + (velocity + sigma * score) * 0.04
    elif last == "euler":
        x = x + velocity * 0.04
    else:
        alpha = sit_coefficients(name, torch.full((3, 1, 1, 1), float(times[-1]), dtype=torch.float64))[0]
        x = x / alpha + sigma ** 2 / alpha * score
    torch.testing.assert_close(ours.double(), x, rtol=1e-4, atol=1e-4)


def test_sampling_intervals_are_sits():
    linear_v, gvp_noise, vp_v = FlowObjective(), FlowObjective(path="gvp", prediction="noise"), FlowObjective(path="vp")
    assert linear_v.sampling_interval() == (0.0, 1.0) and linear_v.sampling_interval(True, 0.04) == (0.0, 0.96)
    assert gvp_noise.sampling_interval() == (1e-3, 1 - 1e-3) and gvp_noise.sampling_interval(True, 0.04) == (1e-3, 0.96)
    assert vp_v.sampling_interval() == (0.0, 1 - 1e-3) and vp_v.training_interval == (0.0, 1 - 1e-5)


def test_specs_round_trip_and_what_does_not_fit_is_refused():
    spec = FlowObjective(path="vp", prediction="noise", loss_weight="likelihood").spec()
    assert (spec["path"], spec["prediction"], spec["loss_weight"]) == ("vp", "noise", "likelihood")
    assert build_objective(spec).spec() == spec
    assert "loss_weight" not in FlowObjective().spec()  # older specs keep reading the same
    with pytest.raises(UserError, match="loss_weight=velocity weighs a score or noise prediction"):
        FlowObjective(loss_weight="velocity")
    with pytest.raises(UserError, match="cosine_loss_weight is LightningDiT's loss on a predicted velocity"):
        FlowObjective(prediction="score", cosine_loss_weight=1.0)
    with pytest.raises(UserError, match="unknown diffusion.path 'cosine'; choose linear or gvp or vp"):
        FlowObjective(path="cosine")
    with pytest.raises(UserError, match="diffusion.path=gvp applies only to diffusion.objective=flow"):
        build_objective({"objective": "ddpm", "path": "gvp"})
    assert math.isclose(FlowObjective(path="vp").diffusion(0.5, 2.0), 2 * float(sit_coefficients(
        "vp", torch.tensor(0.5, dtype=torch.float64))[2]))


@pytest.mark.slow
@pytest.mark.parametrize("path,prediction,weight", [("gvp", "noise", "none"), ("vp", "score", "likelihood")])
def test_digits_runs_of_the_new_objectives_learn_and_their_checkpoints_sample(tmp_path, path, prediction, weight):
    import json

    from helpers import accelerate_state, tiny_config
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.training import train

    common = ["diffusion.objective=flow", "model.learn_sigma=false", f"diffusion.path={path}",
              f"diffusion.prediction={prediction}", f"diffusion.loss_weight={weight}", "train.max_steps=30",
              "train.log_every=5", "train.lr=2e-3", "train.ckpt_every=30"]
    with accelerate_state():
        train(tiny_config(tmp_path / "run", *common))
    rows = [json.loads(line) for line in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    model, spec = load_trained_model(tmp_path / "run/checkpoints/0000030")
    assert (spec["diffusion"]["path"], spec["diffusion"]["prediction"]) == (path, prediction)
    x = sample_latents(model, spec["diffusion"], [0, 1], sampler="heun", steps=5)
    assert torch.isfinite(x).all()
