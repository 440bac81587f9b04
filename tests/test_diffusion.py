"""The diffusion objective against independent computations (closed forms written differently,
numeric integration, scipy's normal CDF, ADM's respacing rule, diffusers' schedule)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from ancre_dit.diffusion.gaussian import create_diffusion, discretized_gaussian_log_likelihood, linear_betas, normal_kl


def _kl_closed_form(m1, s1, m2, s2):
    """KL(N(m1, s1^2) || N(m2, s2^2)) in the textbook form (log ratio of std devs)."""
    return np.log(s2 / s1) + (s1 ** 2 + (m1 - m2) ** 2) / (2 * s2 ** 2) - 0.5


@pytest.mark.parametrize("m1,s1,m2,s2", [(0.0, 1.0, 0.0, 1.0), (0.3, 0.5, -0.2, 1.3), (1.5, 2.0, 1.0, 0.7)])
def test_normal_kl_matches_numeric_integration(m1, s1, m2, s2):
    p, q = stats.norm(m1, s1), stats.norm(m2, s2)
    numeric, _ = integrate.quad(lambda x: p.pdf(x) * (p.logpdf(x) - q.logpdf(x)), -30, 30, limit=200)
    ours = normal_kl(torch.tensor(m1, dtype=torch.float64), torch.tensor(2 * math.log(s1), dtype=torch.float64),
                     torch.tensor(m2, dtype=torch.float64), torch.tensor(2 * math.log(s2), dtype=torch.float64))
    assert ours.item() == pytest.approx(numeric, abs=1e-8)
    assert ours.item() == pytest.approx(_kl_closed_form(m1, s1, m2, s2), abs=1e-12)


def _decoder_loglik_scipy(x: float, mean: float, std: float) -> float:
    """log P(bin of x) under N(mean, std^2), bins of width 2/255, edge bins open to +-inf."""
    half = 1.0 / 255.0
    if x < -0.999:
        return float(stats.norm.logcdf(x + half, mean, std))
    if x > 0.999:
        return float(stats.norm.logsf(x - half, mean, std))
    return float(np.log(stats.norm.cdf(x + half, mean, std) - stats.norm.cdf(x - half, mean, std)))


@pytest.mark.parametrize("x", [-1.0, 0.0, 1.0])
@pytest.mark.parametrize("mean_offset,std", [(0.0, 0.01), (0.004, 0.02), (-0.03, 0.05)])
def test_decoder_nll_matches_scipy_bins(x, mean_offset, std):
    mean = x + mean_offset
    ours = discretized_gaussian_log_likelihood(
        torch.tensor([x], dtype=torch.float64), torch.tensor([mean], dtype=torch.float64),
        torch.tensor([math.log(std)], dtype=torch.float64)).item()
    expected = _decoder_loglik_scipy(x, mean, std)
    # The tanh approximation of the normal CDF is good to ~2e-4 absolute; these bins hold
    # probabilities of 0.1..1, so the log-likelihoods agree to well under 1e-2.
    assert ours == pytest.approx(expected, abs=1e-2)
    assert math.exp(ours) == pytest.approx(math.exp(expected), abs=1e-3)


def _schedule(t: int):
    betas = np.linspace(1e-4, 0.02, 1000)
    abar = np.cumprod(1 - betas)
    abar_prev = abar[t - 1] if t > 0 else 1.0
    return betas[t], abar[t], abar_prev


def test_vb_term_equals_direct_kl_and_decoder_nll():
    torch.manual_seed(0)
    diffusion = create_diffusion(learn_sigma=True)
    x0 = torch.tensor([[-1.0, 0.0], [1.0, 0.5]]).reshape(1, 1, 2, 2).repeat(2, 1, 1, 1)
    x_t = torch.randn(2, 1, 2, 2)
    eps = torch.randn(2, 1, 2, 2)
    # At t = 0 a model that almost knows the noise keeps the decoder's bins well populated.
    noise = torch.randn(1, 1, 2, 2)
    x_t[1:] = diffusion.q_sample(x0[1:], torch.tensor([0]), noise)
    eps[1:] = noise + 0.3 * torch.randn(1, 1, 2, 2)
    v = torch.rand(2, 1, 2, 2) * 2 - 1
    times = [400, 0]
    bpd = diffusion.vb_terms_bpd(torch.cat([eps, v], 1), x0, x_t, torch.tensor(times))

    # t = 400: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)) from the textbook posterior, per pixel.
    beta, abar, abar_prev = _schedule(400)
    alpha = 1 - beta
    X0, XT, EPS, V = (a[0, 0].double().numpy() for a in (x0, x_t, eps, v))
    post_var = beta * (1 - abar_prev) / (1 - abar)
    post_mean = (np.sqrt(abar_prev) * beta * X0 + np.sqrt(alpha) * (1 - abar_prev) * XT) / (1 - abar)
    pred_x0 = (XT - np.sqrt(1 - abar) * EPS) / np.sqrt(abar)
    model_mean = (np.sqrt(abar_prev) * beta * pred_x0 + np.sqrt(alpha) * (1 - abar_prev) * XT) / (1 - abar)
    frac = (V + 1) / 2
    model_var = np.exp(frac * np.log(beta) + (1 - frac) * np.log(post_var))
    kl = _kl_closed_form(post_mean, np.sqrt(post_var), model_mean, np.sqrt(model_var))
    assert bpd[0].item() == pytest.approx(kl.mean() / np.log(2), rel=1e-4)

    # t = 0: the decoder NLL of x_0 under p(x_0 | x_1), log variance clipped to the t = 1 posterior.
    beta0, abar0, _ = _schedule(0)
    beta1, abar1, abar1_prev = _schedule(1)
    X0, XT, EPS, V = (a[1, 0].double().numpy() for a in (x0, x_t, eps, v))
    pred_x0 = (XT - np.sqrt(1 - abar0) * EPS) / np.sqrt(abar0)
    model_mean = pred_x0  # the posterior at t = 0 is x_0 itself
    min_log = np.log(beta1 * (1 - abar1_prev) / (1 - abar1))
    frac = (V + 1) / 2
    std = np.exp(0.5 * (frac * np.log(beta0) + (1 - frac) * min_log))
    nll = -np.array([[_decoder_loglik_scipy(X0[i, j], model_mean[i, j], std[i, j]) for j in range(2)] for i in range(2)])
    assert bpd[1].item() == pytest.approx(nll.mean() / np.log(2), rel=2e-2)


def test_q_sample_statistics_and_diffusers_forward_process():
    from diffusers import DDPMScheduler

    diffusion = create_diffusion()
    generator = torch.Generator().manual_seed(0)
    x0 = torch.full((20000, 1, 1, 1), 0.5)
    t = torch.full((20000,), 600)
    noise = torch.randn(x0.shape, generator=generator)
    xt = diffusion.q_sample(x0, t, noise)
    _, abar, _ = _schedule(600)
    assert xt.mean().item() == pytest.approx(0.5 * math.sqrt(abar), abs=0.02)
    assert xt.var().item() == pytest.approx(1 - abar, rel=0.03)

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
    x0 = torch.rand(8, 1, 4, 4) * 2 - 1
    noise = torch.randn(8, 1, 4, 4, generator=generator)
    t = torch.tensor([0, 1, 10, 100, 400, 700, 998, 999])
    torch.testing.assert_close(diffusion.q_sample(x0, t, noise), scheduler.add_noise(x0, noise, t), atol=1e-5, rtol=1e-5)


def test_learned_variance_endpoints():
    diffusion = create_diffusion(learn_sigma=True)
    x_t = torch.randn(3, 1, 2, 2)
    t = torch.tensor([1, 250, 999])
    eps = torch.zeros_like(x_t)
    upper = diffusion.p_mean_variance(torch.cat([eps, torch.ones_like(x_t)], 1), x_t, t)
    lower = diffusion.p_mean_variance(torch.cat([eps, -torch.ones_like(x_t)], 1), x_t, t)
    for k, step in enumerate(t.tolist()):
        beta, abar, abar_prev = _schedule(step)
        assert upper.variance[k].flatten()[0].item() == pytest.approx(beta, rel=1e-5)
        assert lower.variance[k].flatten()[0].item() == pytest.approx(beta * (1 - abar_prev) / (1 - abar), rel=1e-5)
    # Fixed sigma uses DiT's "large" variance: beta_t for t > 0.
    fixed = create_diffusion(learn_sigma=False).p_mean_variance(eps, x_t, t)
    assert fixed.variance[2].flatten()[0].item() == pytest.approx(_schedule(999)[0], rel=1e-5)


def test_hybrid_loss_vlb_trains_only_the_variance_channels():
    diffusion = create_diffusion(learn_sigma=True)
    output = torch.randn(4, 2, 3, 3, requires_grad=True)

    def model(x, t, y):
        return output * 1.0

    x0 = torch.rand(4, 1, 3, 3) * 2 - 1
    t = torch.tensor([0, 10, 500, 999])
    terms = diffusion.training_losses(model, x0, t, {"y": torch.zeros(4, dtype=torch.long)},
                                      noise=torch.randn(4, 1, 3, 3))
    (grad_vb,) = torch.autograd.grad(terms["vb"].sum(), output, retain_graph=True)
    assert grad_vb[:, :1].abs().max().item() == 0.0  # the mean is detached in the VLB term
    assert grad_vb[:, 1:].abs().max().item() > 0.0
    (grad_mse,) = torch.autograd.grad(terms["mse"].sum(), output, retain_graph=True)
    assert grad_mse[:, 1:].abs().max().item() == 0.0 and grad_mse[:, :1].abs().max().item() > 0.0
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])

    fixed = create_diffusion(learn_sigma=False).training_losses(
        lambda x, t, y: output[:, :1] * 1.0, x0, t, {"y": torch.zeros(4, dtype=torch.long)},
        noise=torch.randn(4, 1, 3, 3))
    assert "vb" not in fixed and torch.equal(fixed["loss"], fixed["mse"])


def test_respacing_250_matches_adm():
    expected = sorted({round(i * 999 / 249) for i in range(250)})
    assert len(expected) == 250
    base = create_diffusion()
    spaced = create_diffusion(respacing="250")
    assert spaced.num_timesteps == 250
    assert spaced.timestep_map.tolist() == expected
    # The respaced chain keeps the marginals: its alphas_cumprod are the original ones at the kept steps.
    np.testing.assert_allclose(spaced.alphas_cumprod, base.alphas_cumprod[expected], rtol=1e-12)
    assert spaced.model_timesteps(torch.tensor([0, 249])).tolist() == [0, 999]


def test_linear_betas_match_diffusers():
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
    ours = torch.from_numpy(linear_betas(1000)).float()
    torch.testing.assert_close(ours, scheduler.betas.float(), rtol=0, atol=1e-8)
    assert abs(ours[0].item() - 1e-4) < 1e-9 and abs(ours[-1].item() - 0.02) < 1e-9
