"""The flow-matching objective (SiT's linear interpolant, velocity prediction): its conventions,
its loss against the closed form for Gaussian data, every flow sampler driven by the exact velocity
field, exact resume, 1 vs 2 sampling processes, and the one-line refusals."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from helpers import accelerate_state, assert_same_weights, run_forked_ranks, script_main, tiny_config
from test_sampling import DIGITS, REPO, TINY, random_model, run_sample

from ancre_dit.diffusion import FlowObjective, build_objective
from ancre_dit.errors import UserError
from ancre_dit.sampling import Guidance, GuidedDenoiser, sample_latents
from ancre_dit.checkpoint import make_model_spec, write_model_files
from ancre_dit.training import train
from ancre_dit.training.config import load_config

FLOW = FlowObjective().spec()
FLOW_TINY = {**TINY, "learn_sigma": False}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ExactGaussianVelocity(torch.nn.Module):
    """The optimal velocity for data N(+-MU, S^2) per dimension (class 1: +MU, class 0: -MU) under
    SiT's convention x_t = t x1 + (1 - t) x0, x1 data, x0 ~ N(0, 1), target u = x1 - x0:
    v*(x, t) = E[u | x_t = x] = mu + (t S^2 - (1 - t)) / (t^2 S^2 + (1 - t)^2) (x - t mu)."""

    num_classes, in_channels, input_size = 2, 1, 4
    MU, S = 0.5, 0.5

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(()))
        self.seen_t: list[float] = []

    def forward(self, x, t, y):
        self.seen_t.append(float(t[0]))
        t = t.float().reshape(-1, 1, 1, 1)
        mu = self.MU * (2 * y.float() - 1).reshape(-1, 1, 1, 1)
        s2 = self.S ** 2
        return mu + (t * s2 - (1 - t)) / (t ** 2 * s2 + (1 - t) ** 2) * (x - t * mu)


def residual_variance(t: np.ndarray | float, s: float = ExactGaussianVelocity.S):
    """E[(v*(x_t, t) - u)^2] per dimension: Var(u) - Cov(u, x_t)^2 / Var(x_t) = S^2 / (t^2 S^2 + (1 - t)^2)."""
    return s ** 2 / (t ** 2 * s ** 2 + (1 - t) ** 2)


def gaussian_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    mu = ExactGaussianVelocity.MU * (2 * y.float() - 1).reshape(-1, 1, 1, 1)
    return mu + ExactGaussianVelocity.S * torch.randn(n, 1, 4, 4, generator=g), y


# -- SiT's conventions ----------------------------------------------------------------------------
def test_interpolant_and_velocity_follow_sit():
    objective = FlowObjective()
    data, noise = torch.full((2, 1, 2, 2), 3.0), torch.full((2, 1, 2, 2), -1.0)
    x_t, u = objective.interpolate(data, noise, torch.tensor([0.0, 1.0]))
    assert torch.equal(x_t[0], noise[0]) and torch.equal(x_t[1], data[1])  # t = 0 noise, t = 1 data
    assert torch.equal(u, data - noise)  # velocity = data - noise
    assert objective.normalized_time(0.0) == 1.0 and objective.normalized_time(1.0) == 0.0
    # The network gets t as a float in [0, 1], unscaled; the ODE runs from t = 0 to t = 1.
    model = ExactGaussianVelocity()
    sample_latents(model, objective, [0, 1], sampler="euler", steps=4)
    assert model.seen_t == [0.0, 0.25, 0.5, 0.75]


# -- the loss against its closed form --------------------------------------------------------------
@pytest.mark.parametrize("time_sampling", ["uniform", "logit-normal"])
def test_flow_loss_of_the_exact_field_equals_its_analytic_value(time_sampling):
    objective = FlowObjective(time_sampling)
    x, y = gaussian_batch(40_000)
    draws = objective.draw(x, torch.Generator().manual_seed(1))
    loss = objective.losses(ExactGaussianVelocity(), x, y, draws)["loss"].mean().item()
    if time_sampling == "uniform":
        expected = integrate.quad(residual_variance, 0, 1)[0]
    else:  # logit-normal(0, 1) density of t
        density = lambda t: stats.norm.pdf(math.log(t / (1 - t))) / (t * (1 - t))  # noqa: E731
        expected = integrate.quad(lambda t: residual_variance(t) * density(t), 0, 1)[0]
    assert abs(loss - expected) < 0.02 * expected, (loss, expected)
    # At fixed times the per-time closed form holds too (this is where a sign or an end mix-up shows).
    for t in (0.1, 0.5, 0.9):
        at_t = objective.losses(ExactGaussianVelocity(), x, y, (torch.full((len(x),), t), draws[1]))["loss"].mean()
        assert abs(at_t.item() - residual_variance(t)) < 0.02 * residual_variance(t), (t, at_t)


# -- every flow sampler on Gaussian data -----------------------------------------------------------
@pytest.mark.parametrize("sampler,steps", [("euler", 50), ("heun", 25), ("dopri5", None),
                                           pytest.param("sde", 250, marks=pytest.mark.slow)])
def test_flow_samplers_recover_gaussian_data_from_the_exact_velocity(sampler, steps):
    """Tolerances (1000 samples of 16 dimensions per class): each class's overall mean within 0.03 of
    +-0.5; its mean per-dimension variance within 8% of S^2 = 0.25 (Euler-50's first-order error
    alone makes it 6% low, SiT's "mean" last step, which adds no noise over the last 0.04, 3.5% low;
    Heun and dopri5 land within 0.5%); every covariance between two dimensions below 0.05."""
    labels = np.arange(2000) % 2
    x = sample_latents(ExactGaussianVelocity(), FLOW, labels, sampler=sampler, steps=steps, seed=1)
    for c, sign in ((0, -1), (1, 1)):
        values = x[torch.from_numpy(labels) == c].flatten(1).double()
        assert abs(values.mean().item() - sign * 0.5) < 0.03
        cov = torch.cov(values.T)
        assert abs(cov.diagonal().mean().item() - 0.25) < 0.08 * 0.25, cov.diagonal()
        assert (cov - torch.diag(cov.diagonal())).abs().max().item() < 0.05


def test_sde_last_step_options_all_recover_the_data():
    from ancre_dit.diffusion import SDEOptions

    labels = np.arange(200) % 2
    for last in ("mean", "tweedie", "euler", "none"):
        x = sample_latents(ExactGaussianVelocity(), FLOW, labels, sampler="sde", steps=100, seed=2,
                           sde=SDEOptions(last_step=last))
        ones = x[torch.from_numpy(labels) == 1]
        assert abs(ones.mean().item() - 0.5) < 0.04 and 0.42 < ones.std().item() < 0.56, last


# -- guidance ---------------------------------------------------------------------------------------
def test_guidance_interval_is_normalised_time_for_flow():
    model = random_model(learn_sigma=False)
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([4, 5])
    flow = FlowObjective()
    denoise = GuidedDenoiser(model, Guidance(4.0, interval=(0.0, 0.5)), normalized_time=flow.normalized_time)
    for t, guided in ((0.2, False), (0.5, True), (0.9, True)):  # u = 1 - t
        tt = torch.full((2,), t)
        assert torch.equal(denoise(x, tt, y), GuidedDenoiser(model, Guidance(4.0 if guided else 1.0))(x, tt, y))
    # The 3-channel mode guides only the first three velocity channels.
    four = random_model(in_channels=4, learn_sigma=False)
    x4, tt = torch.randn(3, 4, 8, 8), torch.full((3,), 0.3)
    cond = GuidedDenoiser(four, Guidance(1.0))(x4, tt, y[:1].repeat(3))
    three = GuidedDenoiser(four, Guidance(4.0, channels=3))(x4, tt, y[:1].repeat(3))
    assert three.shape == (3, 4, 8, 8)
    torch.testing.assert_close(three[:, 3:], cond[:, 3:])  # channel 3: conditional only
    assert (three[:, :3] - cond[:, :3]).abs().max() > 1e-3
    # Outside normalised time: refused.
    with pytest.raises(UserError, match=r"must lie in \[0, 1\]: it is in normalised time"):
        Guidance(2.0, interval=(100, 600))


# -- checkpoints, refusals ------------------------------------------------------------------------------
def write_flow_ckpt(folder: Path) -> Path:
    model = random_model(learn_sigma=False)
    write_model_files(folder, make_model_spec("DiT-T/2", FLOW_TINY, FLOW, DIGITS, step=3), model.state_dict(),
                      model.state_dict())
    return folder


def test_specs_rebuild_their_objective_and_samplers_that_do_not_fit_are_refused(tmp_path):
    ddpm_spec = dict(objective="ddpm", num_timesteps=1000, beta_start=1e-4, beta_end=0.02, learn_sigma=True)
    ddpm = build_objective(ddpm_spec)
    assert ddpm.name == "ddpm" and ddpm.spec() == ddpm_spec
    assert build_objective(FLOW).spec() == FLOW
    ckpt = write_flow_ckpt(tmp_path / "flow")
    with pytest.raises(UserError, match=r"--sampler ddpm does not fit this flow checkpoint; choose euler, heun, dopri5 or sde"):
        run_sample("--ckpt", str(ckpt), "--sampler", "ddpm", "--out", str(tmp_path / "x.npz"))
    model = random_model()
    with pytest.raises(UserError, match=r"^sampler heun does not fit this ddpm checkpoint; choose ddpm, ddim or dpm-solver"):
        sample_latents(model, ddpm_spec, [1], sampler="heun")
    with pytest.raises(UserError, match="apply only to --sampler sde"):
        run_sample("--ckpt", str(ckpt), "--sampler", "heun", "--sde-last-step", "none", "--out", str(tmp_path / "x.npz"))
    # Flow checkpoints sample with the objective's default (heun-25) and the flags given.
    run_sample("--ckpt", str(ckpt), "--num-samples", "4", "--cfg-scale", "2", "--out", str(tmp_path / "d.npz"))
    with np.load(tmp_path / "d.npz") as f:
        assert f["arr_0"].shape == (4, 8, 8, 3)


def test_config_checks_the_diffusion_section(tmp_path):
    base = [f"run_dir={tmp_path}", "data.kind=digits", "data.image_size=8"]
    with pytest.raises(UserError, match="set model.learn_sigma=false"):
        load_config(None, [*base, "diffusion.objective=flow"])
    with pytest.raises(UserError, match="diffusion.objective must be 'ddpm' or 'flow'"):
        load_config(None, [*base, "diffusion.objective=edm"])
    with pytest.raises(UserError, match="applies only to diffusion.objective=flow"):
        load_config(None, [*base, "diffusion.time_sampling=logit-normal"])
    with pytest.raises(UserError, match="time_sampling"):
        load_config(None, [*base, "model.learn_sigma=false", "diffusion.objective=flow", "diffusion.time_sampling=beta"])
    for name in ("sit-s2-ancre", "sit-s2-cascaded", "sit-b2-ancre", "sit-b2-cascaded", "digits-flow-ancre"):
        c = load_config(REPO / "configs" / f"{name}.yaml", ["data.kind=digits", "data.image_size=8"])
        assert c.diffusion.objective == "flow" and not c.model.learn_sigma


# -- training and processes --------------------------------------------------------------------------
@pytest.mark.slow
def test_flow_resume_is_bitwise_exact_and_the_spec_records_the_objective(tmp_path):
    from ancre_dit.checkpoint import load_trained_model

    common = ["train.ckpt_every=3", "model.learn_sigma=false", "model.class_dropout=0.1", "diffusion.objective=flow",
              "diffusion.time_sampling=logit-normal", "diffusion.logit_std=0.8"]
    with accelerate_state():
        train(tiny_config(tmp_path / "straight", "train.max_steps=6", *common))
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=3", *common))
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=6", *common), resume="auto")
    a, b = tmp_path / "straight" / "checkpoints" / "0000006", tmp_path / "split" / "checkpoints" / "0000006"
    assert_same_weights(a, b)
    _, spec = load_trained_model(a)
    assert spec["diffusion"] == {"objective": "flow", "path": "linear", "prediction": "velocity",
                                 "time_sampling": "logit-normal", "logit_mean": 0.0, "logit_std": 0.8,
                                 "learn_sigma": False}


@pytest.mark.slow
def test_one_and_two_processes_give_identical_flow_samples(tmp_path, capfd):
    """sample.py in this process and on two gloo ranks forked from it (tests/test_sampling.py runs
    it under torchrun)."""
    ckpt = write_flow_ckpt(tmp_path / "ckpt")
    common = ["--ckpt", str(ckpt), "--num-samples", "10", "--batch-size", "3", "--sampler", "sde", "--steps", "6",
              "--cfg-scale", "2", "--seed", "3"]
    run_sample(*common, "--out", str(tmp_path / "one.npz"))
    capfd.readouterr()
    run_forked_ranks(script_main(REPO / "sample.py", *common, "--out", str(tmp_path / "two.npz")), 2)
    out = capfd.readouterr().out
    assert "2 process(es)" in out and "flow sde-6" in out
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        assert np.array_equal(one["arr_0"], two["arr_0"]) and np.array_equal(one["arr_1"], two["arr_1"])
        assert one["arr_0"].std() > 0


def test_the_cosine_loss_is_lightningdits_beside_the_mse():
    """LightningDiT's transport: 1 - cosine_similarity(v_pred, v, dim=1), averaged like the MSE, added
    to it; here with a weight. Written again from the definition of the cosine."""
    from ancre_dit.errors import UserError

    torch.manual_seed(0)
    x, noise, t, y = torch.randn(3, 4, 6, 6), torch.randn(3, 4, 6, 6), torch.rand(3), torch.tensor([0, 1, 2])
    prediction = torch.randn(3, 4, 6, 6)
    net = lambda x_t, t, y: prediction  # noqa: E731
    plain = build_objective({"objective": "flow", "learn_sigma": False})
    with_cos = build_objective({"objective": "flow", "learn_sigma": False, "cosine_loss_weight": 0.5})
    target = x - noise
    dot = (prediction * target).sum(1)
    cosine = dot / (prediction.norm(dim=1).clamp_min(1e-8) * target.norm(dim=1).clamp_min(1e-8))
    expected_cos = (1 - cosine).flatten(1).mean(1)
    expected_mse = ((prediction - target) ** 2).flatten(1).mean(1)
    terms = with_cos.losses(net, x, y, (t, noise))
    torch.testing.assert_close(terms["cos"], expected_cos)
    torch.testing.assert_close(terms["loss"], expected_mse + 0.5 * expected_cos)
    assert set(plain.losses(net, x, y, (t, noise))) == {"mse", "loss"} and "cosine_loss_weight" not in plain.spec()
    assert with_cos.spec()["cosine_loss_weight"] == 0.5
    assert build_objective(with_cos.spec()).cosine_loss_weight == 0.5  # a checkpoint's spec rebuilds it
    with pytest.raises(UserError, match="diffusion.cosine_loss_weight=1.0 applies only to diffusion.objective=flow"):
        build_objective({"objective": "ddpm", "cosine_loss_weight": 1.0})


@pytest.mark.slow
def test_a_flow_run_with_the_cosine_loss_learns_and_logs_it(tmp_path):
    import json

    common = ["diffusion.objective=flow", "model.learn_sigma=false", "diffusion.cosine_loss_weight=1.0",
              "train.max_steps=30", "train.log_every=5", "train.lr=2e-3"]
    with accelerate_state():
        train(tiny_config(tmp_path / "run", *common))
    rows = [json.loads(line) for line in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()]
    assert "cos" in rows[0] and rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["cos"] < rows[0]["cos"]


def test_repas_lognormal_weighting_is_the_logit_normal_time_at_mean_0_std_1():
    """REPA's loss.py, weighting "lognormal" on the linear path: sigma = exp(n), n ~ N(0, 1), and
    t_REPA = sigma / (1 + sigma) with t_REPA = 0 the data; in SiT's time (1 the data) that is
    1 - t_REPA = sigmoid(-n), distributed as our logit-normal sigmoid(0 + 1 * n)."""
    n = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    sigma = n.exp()
    repa_in_our_time = 1 - sigma / (1 + sigma)
    ours, _ = build_objective({"objective": "flow", "learn_sigma": False, "time_sampling": "logit-normal",
                               "logit_mean": 0.0, "logit_std": 1.0}).draw(torch.zeros(200_000, 1), torch.Generator())
    levels = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    torch.testing.assert_close(torch.quantile(ours, levels), torch.quantile(repa_in_our_time, levels), atol=4e-3, rtol=0)


# -- LightningDiT's timestep shift ------------------------------------------------------------------
def lightningdit_shift(t: float, s: float) -> float:
    """LightningDiT's transport/integrators.py: t_m = s t_n / (1 + (s - 1) t_n), on SiT's times."""
    return s * t / (1 + (s - 1) * t)


class RecordingField(ExactGaussianVelocity):
    """dv/dt = -x + t per dimension, recording the times it is asked at."""

    def forward(self, x, t, y):
        self.seen_t.append(float(t[0]))
        return -x + t.reshape(-1, 1, 1, 1)


def test_the_time_shift_is_lightningdits_on_the_euler_grid():
    from ancre_dit.diffusion.flow_samplers import shifted_times

    grid = torch.linspace(0, 1, 11, dtype=torch.float64)
    expected = torch.tensor([lightningdit_shift(float(t), 0.3) for t in grid], dtype=torch.float64)
    torch.testing.assert_close(shifted_times(grid, 0.3), expected)
    assert torch.equal(shifted_times(grid, 1.0), grid)
    # Euler on the shifted grid, written out, against the sampler with --time-shift.
    field, steps, shift = RecordingField(), 8, 0.3
    x = sample_latents(field, FLOW, [0, 1], sampler="euler", steps=steps, seed=3, time_shift=shift,
                       guidance=Guidance(1.0))
    times = [lightningdit_shift(k / steps, shift) for k in range(steps + 1)]
    np.testing.assert_allclose(field.seen_t, times[:-1], atol=1e-6)
    from ancre_dit.sampling.api import SampleNoise
    manual = SampleNoise(3, [0, 1], (1, 4, 4), torch.device("cpu")).next().double()
    for t0, t1 in zip(times[:-1], times[1:]):
        manual = manual + (t1 - t0) * (-manual + t0)
    torch.testing.assert_close(x.double(), manual, atol=1e-5, rtol=1e-5)
    # The shift moves most of the steps towards the noise (t = 0): half of them below t = 0.23.
    assert times[steps // 2] < 0.25


def test_a_time_shift_is_refused_where_no_fixed_grid_bends(tmp_path):
    ckpt = write_flow_ckpt(tmp_path / "flow")
    out = str(tmp_path / "x.npz")
    with pytest.raises(UserError, match=r"^--time-shift 0.3 bends a fixed time grid, which sampler sde does not run on; "
                                        r"choose euler or heun"):
        run_sample("--ckpt", str(ckpt), "--sampler", "sde", "--time-shift", "0.3", "--out", out)
    with pytest.raises(UserError, match=r"^--time-shift -1.0 must be a positive number"):
        run_sample("--ckpt", str(ckpt), "--sampler", "euler", "--time-shift", "-1", "--out", out)
    with pytest.raises(UserError, match=r"^eval.time_shift 0.3 bends a fixed time grid, which sampler dopri5"):
        load_config(None, [f"run_dir={tmp_path / 'run'}", "data.kind=digits", "data.image_size=8",
                           "model.learn_sigma=false", "diffusion.objective=flow", "eval.sampler=dopri5",
                           "eval.time_shift=0.3"])
    # A shifted job is another job: its parts are not resumed by an unshifted one.
    run_sample("--ckpt", str(ckpt), "--sampler", "euler", "--steps", "4", "--time-shift", "0.3", "--num-samples", "2",
               "--keep-parts", "--out", out)
    assert json.loads((tmp_path / "x.parts" / "job.json").read_text())["time_shift"] == 0.3
    with pytest.raises(UserError, match=r"holds parts of a different job \(time_shift changed\)"):
        run_sample("--ckpt", str(ckpt), "--sampler", "euler", "--steps", "4", "--num-samples", "2", "--out", out)
