"""sample.py and ancre_dit.sampling: determinism, guidance, the DDPM step against ADM's formulas,
ADM respacing, sharded/resumed jobs, VAE decoding and the one-line errors."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY_DIT, load_script, tiny_model

from ancre_dit.diffusion import SDEOptions, build_objective
from ancre_dit.cli import SingleProcess
from ancre_dit.errors import UserError
from ancre_dit.sampling import GuidedDenoiser, Guidance, SampleNoise, sample_images, sample_latents
from ancre_dit.sampling import job as job_module
from ancre_dit.sampling.api import decode_pixels
from ancre_dit.diffusion.ddpm import ddpm_sampler, respaced_diffusion
from ancre_dit.checkpoint import make_model_spec, write_model_files

REPO = ROOT
DIFFUSION = dict(objective="ddpm", num_timesteps=1000, beta_start=1e-4, beta_end=0.02, learn_sigma=True)
TINY = {**TINY_DIT, "learn_sigma": True, "topology": "cascaded"}  # the model kwargs written to checkpoints
DIGITS = dict(kind="digits", image_size=8, image_channels=1, num_classes=10, vae=None, scaling_factor=None)


pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny DiT with every weight random (DiT's adaLN-Zero init would make it output zeros)."""
    model = tiny_model(seed=seed, **{**TINY, **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    return model.eval()


def write_ckpt(folder: Path, model: torch.nn.Module, model_kwargs: dict, data: dict = DIGITS) -> Path:
    spec = make_model_spec("DiT-T/2", model_kwargs, DIFFUSION, data, step=7)
    write_model_files(folder, spec, model.state_dict(), model.state_dict())
    return folder


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory) -> Path:
    return write_ckpt(tmp_path_factory.mktemp("ckpt") / "checkpoints" / "7", random_model(), TINY)


def run_sample(*args: str) -> None:
    load_script(REPO / "sample.py").main(list(args))


# -- determinism -------------------------------------------------------------------------------
def test_same_seed_same_images_whatever_the_batch():
    model = random_model()
    labels = [3, 1, 4, 1, 5, 9]
    a = sample_latents(model, DIFFUSION, labels, seed=5, steps=8, guidance=Guidance(2.0))
    b = sample_latents(model, DIFFUSION, labels, seed=5, steps=8, guidance=Guidance(2.0))
    assert torch.equal(a, b)
    # Sample i depends only on (seed, i): the same indices in other batches give the same samples.
    # In float64, so that the check is exact: float32 CPU kernels may pick another blocking for
    # another batch size and differ in the last bits, which says nothing about the sampler's streams.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model64 = random_model().double()
        whole = sample_latents(model64, DIFFUSION, labels, seed=5, steps=8, guidance=Guidance(2.0))
        first = sample_latents(model64, DIFFUSION, labels[:2], indices=[0, 1], seed=5, steps=8, guidance=Guidance(2.0))
        rest = sample_latents(model64, DIFFUSION, labels[2:], indices=[2, 3, 4, 5], seed=5, steps=8,
                              guidance=Guidance(2.0))
    finally:
        torch.set_default_dtype(previous)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=0, atol=1e-12)
    other = sample_latents(model, DIFFUSION, labels, seed=6, steps=8, guidance=Guidance(2.0))
    assert (other - a).abs().mean() > 0.1
    for sampler in ("ddim", "dpm-solver"):
        x = sample_images(model, DIFFUSION, labels, seed=5, steps=4, sampler=sampler, guidance=Guidance(2.0))
        assert x.dtype == np.uint8 and x.shape == (6, 8, 8, 1)
        assert np.array_equal(x, sample_images(model, DIFFUSION, labels, seed=5, steps=4, sampler=sampler,
                                               guidance=Guidance(2.0)))


def sample_with_one_and_two_processes(common: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """sample.py with `common` flags in this process (-> one.npz) and under torchrun with 2 CPU processes (-> two.npz)."""
    run_sample(*common, "--out", str(tmp_path / "one.npz"))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "sample.py"), *common, "--out", str(tmp_path / "two.npz")]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_one_and_two_processes_give_identical_npz(digits_ckpt, tmp_path):
    common = ["--ckpt", str(digits_ckpt), "--num-samples", "10", "--batch-size", "3", "--steps", "6",
              "--cfg-scale", "2", "--seed", "3"]
    proc = sample_with_one_and_two_processes(common, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "2 process(es)" in proc.stdout
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        assert sorted(one.files) == sorted(two.files) == ["arr_0", "arr_1"]
        assert np.array_equal(one["arr_0"], two["arr_0"]) and np.array_equal(one["arr_1"], two["arr_1"])
        assert one["arr_0"].std() > 0


# -- the npz and the CLI -----------------------------------------------------------------------
def test_npz_loads_back_in_adm_layout(digits_ckpt, tmp_path):
    out = tmp_path / "s.npz"
    run_sample("--ckpt", str(digits_ckpt), "--num-samples", "12", "--batch-size", "5", "--steps", "3",
               "--sampler", "dpm-solver", "--out", str(out), "--grid", str(tmp_path / "grid.png"),
               "--png-dir", str(tmp_path / "png"))
    with np.load(out) as f:
        images, labels = f["arr_0"], f["arr_1"]
    assert images.dtype == np.uint8 and images.shape == (12, 8, 8, 3)
    assert np.array_equal(images[..., 0], images[..., 2])  # grayscale written as 3 equal channels
    assert labels.dtype == np.int64 and labels.tolist() == [i % 10 for i in range(12)]  # balanced
    assert (tmp_path / "grid.png").is_file() and len(list((tmp_path / "png").glob("*.png"))) == 12
    assert not (tmp_path / "s.parts").exists()  # parts are removed once merged
    # --classes is cycled; the pixels follow the labels.
    run_sample("--ckpt", str(digits_ckpt), "--num-samples", "5", "--steps", "3", "--sampler", "dpm-solver",
               "--classes", "2,7", "--out", str(tmp_path / "c.npz"))
    with np.load(tmp_path / "c.npz") as f:
        assert f["arr_1"].tolist() == [2, 7, 2, 7, 2]


def test_random_classes_depend_only_on_seed_and_index():
    from ancre_dit.sampling import assign_labels

    a = assign_labels(np.arange(200), 10, seed=1, mode="random")
    assert np.array_equal(a[50:60], assign_labels(np.arange(50, 60), 10, seed=1, mode="random"))
    assert len(set(a.tolist())) == 10 and not np.array_equal(a, assign_labels(np.arange(200), 10, seed=2, mode="random"))


def test_interrupted_job_resumes_only_missing_parts(digits_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "r.npz"
    args = ["--ckpt", str(digits_ckpt), "--num-samples", "7", "--batch-size", "3", "--steps", "3",
            "--sampler", "ddim", "--out", str(out), "--keep-parts"]
    run_sample(*args)
    with np.load(out) as f:
        full = f["arr_0"].copy()
    parts = tmp_path / "r.parts"
    assert sorted(p.name for p in parts.glob("part-*")) == [
        "part-0000000-0000003.npz", "part-0000003-0000006.npz", "part-0000006-0000007.npz"]
    # Simulate an interruption after the first part.
    (parts / "part-0000003-0000006.npz").unlink()
    (parts / "part-0000006-0000007.npz").unlink()
    out.unlink()
    calls = []
    real = job_module.sample_part
    monkeypatch.setattr(job_module, "sample_part", lambda *a, **k: calls.append(k["indices"].tolist()) or real(*a, **k))
    run_sample(*args)
    assert calls == [[3, 4, 5], [6]]
    with np.load(out) as f:
        assert np.array_equal(f["arr_0"], full)
    # Resuming with other settings would mix two jobs: refused.
    with pytest.raises(UserError, match="different job"):
        run_sample(*args[:-1], "--cfg-scale", "3")


def test_padded_part_keeps_its_samples():
    """--compile pads the last part to the batch size; the real samples stay those of (seed, i)."""
    model = random_model()
    plan = job_module.plan_sampling(model, DIFFUSION, steps=3, guidance=Guidance(2.0))
    labels, indices = np.array([3, 1]), np.array([6, 7])
    plain = job_module.sample_part(plan, labels, indices=indices, seed=4, decoder=decode_pixels)
    seen, forward = [], model.forward
    model.forward = lambda x, *a, **k: seen.append(len(x)) or forward(x, *a, **k)
    padded = job_module.sample_part(plan, labels, indices=indices, seed=4, decoder=decode_pixels, pad_to=5)
    del model.forward
    assert set(seen) == {10}  # 5 samples, conditional and unconditional halves in one forward
    assert padded.shape == plain.shape == (2, 8, 8, 1)
    assert np.abs(padded.astype(int) - plain.astype(int)).max() <= 1  # float32 kernels may block otherwise


@pytest.mark.slow
def test_compiled_sampling_gives_the_eager_images(digits_ckpt, tmp_path):
    from torch._dynamo.utils import counters

    args = ["--ckpt", str(digits_ckpt), "--num-samples", "5", "--batch-size", "4", "--steps", "3", "--cfg-scale", "2"]
    run_sample(*args, "--out", str(tmp_path / "eager.npz"))
    torch._dynamo.reset()
    counters.clear()
    run_sample(*args, "--out", str(tmp_path / "compiled.npz"), "--compile")
    # It really ran compiled, and the ragged last part (1 of 5) was padded: one graph, no recompile.
    assert counters["frames"]["ok"] >= 1 and counters["stats"]["unique_graphs"] == 1
    with np.load(tmp_path / "eager.npz") as e, np.load(tmp_path / "compiled.npz") as c:
        assert e["arr_0"].std() > 10 and np.array_equal(e["arr_1"], c["arr_1"])
        assert np.abs(e["arr_0"].astype(int) - c["arr_0"].astype(int)).max() <= 2


def test_sampling_sets_up_precision_as_the_trainer(digits_ckpt, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(job_module, "configure_precision", lambda device, tf32: calls.append((str(device), tf32)))
    args = ["--ckpt", str(digits_ckpt), "--num-samples", "1", "--steps", "2", "--out", str(tmp_path / "s.npz")]
    run_sample(*args)
    run_sample(*args, "--no-tf32")
    assert calls == [("cpu", True), ("cpu", False)]


class _Rank(SingleProcess):
    """Process `rank` of `world` without a process group (the job's merge path needs no collective)."""

    def __init__(self, rank: int, world: int):
        super().__init__(cpu=True)
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0


def test_ranks_leave_once_their_parts_are_written_and_the_main_one_merges(digits_ckpt, tmp_path, monkeypatch):
    args = ["--ckpt", str(digits_ckpt), "--num-samples", "7", "--batch-size", "3", "--steps", "2"]
    run_sample(*args, "--out", str(tmp_path / "one.npz"))
    out = tmp_path / "two.npz"
    monkeypatch.setattr(job_module, "job_processes", lambda cpu, timeout_s: contextlib.nullcontext(_Rank(1, 2)))
    run_sample(*args, "--out", str(out))  # rank 1 writes part 3-6 and returns: no barrier, no merge
    assert not out.exists() and [p.name for p in (tmp_path / "two.parts").glob("part-*")] == ["part-0000003-0000006.npz"]
    monkeypatch.setattr(job_module, "job_processes", lambda cpu, timeout_s: contextlib.nullcontext(_Rank(0, 2)))
    run_sample(*args, "--out", str(out))
    with np.load(tmp_path / "one.npz") as one, np.load(out) as two:
        assert np.array_equal(one["arr_0"], two["arr_0"]) and np.array_equal(one["arr_1"], two["arr_1"])


def test_main_process_waits_for_the_part_files(tmp_path):
    ranges = [(0, 2), (2, 3)]
    job_module.save_adm_npz(job_module.part_path(tmp_path, 0, 2), np.zeros((2, 4, 4, 3), np.uint8), [0, 1])
    late = threading.Timer(0.3, lambda: job_module.save_adm_npz(job_module.part_path(tmp_path, 2, 3),
                                                                np.zeros((1, 4, 4, 3), np.uint8), [2]))
    late.start()
    said = []
    job_module.wait_for_parts(tmp_path, ranges, said.append, poll_seconds=0.05)
    late.join()
    assert job_module.part_path(tmp_path, 2, 3).is_file() and said == ["waiting for 1 part(s) from the other processes"]


# -- guidance ---------------------------------------------------------------------------------
def test_cfg_scale_one_is_the_plain_conditional_model():
    model = random_model()
    batch_sizes = []
    model.register_forward_hook(lambda m, inp, out: batch_sizes.append(len(inp[0])))
    x, t, y = torch.randn(4, 1, 8, 8), torch.full((4,), 500), torch.tensor([0, 1, 2, 3])
    out = GuidedDenoiser(model, Guidance(1.0))(x, t, y)
    assert batch_sizes == [4]  # no unconditional half
    assert torch.equal(out, model(x, t, y))
    # A whole sampling run at scale 1 equals DDPM driven by the bare conditional model.
    labels = [0, 5, 9]
    got = sample_latents(model, DIFFUSION, labels, seed=2, steps=5, guidance=Guidance(1.0))
    noise = SampleNoise(2, range(3), (1, 8, 8))
    expected = ddpm_sampler(build_objective(DIFFUSION), lambda a, b, c: model(a, b, c), noise.next(),
                            torch.tensor(labels), noise, steps=5, sde=SDEOptions())
    assert torch.equal(got, expected)
    # Guidance really changes the samples (so the equality above is not vacuous).
    assert not torch.allclose(got, sample_latents(model, DIFFUSION, labels, seed=2, steps=5, guidance=Guidance(3.0)))


def test_three_channel_mode_guides_only_three_channels():
    model = random_model(in_channels=4)
    x, t, y = torch.randn(3, 4, 8, 8), torch.full((3,), 300), torch.tensor([1, 2, 3])
    cond = GuidedDenoiser(model, Guidance(1.0))(x, t, y)
    full = GuidedDenoiser(model, Guidance(4.0))(x, t, y)
    three = GuidedDenoiser(model, Guidance(4.0, channels=3))(x, t, y)
    assert cond.shape == (3, 8, 8, 8)
    torch.testing.assert_close(three[:, :3], full[:, :3])  # guided like the default on channels 0-2
    torch.testing.assert_close(three[:, 3:], cond[:, 3:])  # channel 3 and the variance: conditional
    assert (full[:, 3] - cond[:, 3]).abs().max() > 1e-3  # default guidance does change channel 3
    assert (three[:, :3] - cond[:, :3]).abs().max() > 1e-3


def test_guidance_interval_guides_only_inside():
    model = random_model()
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([4, 5])
    # The interval is in normalised time (0 = data, 1 = noise): DDPM timestep t is t / 999.
    ddpm = build_objective(DIFFUSION)
    denoise = GuidedDenoiser(model, Guidance(4.0, interval=(100 / 999, 600 / 999)), normalized_time=ddpm.normalized_time)
    for step, guided in ((50, False), (100, True), (600, True), (900, False)):
        t = torch.full((2,), step)
        reference = GuidedDenoiser(model, Guidance(4.0 if guided else 1.0))(x, t, y)
        assert torch.equal(denoise(x, t, y), reference)


# -- DDPM against ADM's formulas ---------------------------------------------------------------
class ToyLearnedSigma(torch.nn.Module):
    """eps and the variance interpolation v in [-1, 1] as simple closed forms of (x, t, y)."""

    num_classes, in_channels, input_size = 3, 1, 2

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.7))
        self.seen_t = []

    def forward(self, x, t, y):
        self.seen_t.append(t.tolist())
        tt = t.float().reshape(-1, 1, 1, 1) / 1000
        eps = self.w * torch.tanh(x) + 0.3 * tt + 0.1 * y.float().reshape(-1, 1, 1, 1)
        v = torch.tanh(0.5 * x - tt + 0.2 * y.float().reshape(-1, 1, 1, 1))
        return torch.cat([eps, v], dim=1)


def test_ddpm_steps_match_adm_posterior_formulas():
    toy = ToyLearnedSigma()
    labels, seed, steps = [0, 2], 11, 3
    got = sample_latents(toy, DIFFUSION, labels, seed=seed, steps=steps, guidance=Guidance(1.0)).double().numpy()

    # ADM, written out: linear betas, respaced to 3 of 1000 steps with stride (1000-1)/(3-1).
    betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
    abar_full = np.cumprod(1 - betas)
    use = [0, 500, 999]
    abar = abar_full[use]
    abar_prev = np.append(1.0, abar[:-1])
    beta = 1 - abar / abar_prev
    post_var = beta * (1 - abar_prev) / (1 - abar)
    post_log_var_clipped = np.log(np.append(post_var[1], post_var[1:]))

    noise = SampleNoise(seed, range(2), (1, 2, 2))
    x = noise.next().double().numpy()
    y = torch.tensor(labels)
    for k in (2, 1, 0):
        with torch.no_grad():
            out = toy(torch.from_numpy(x).float(), torch.full((2,), use[k]), y).double().numpy()
        eps, v = out[:, :1], out[:, 1:]
        x0 = np.sqrt(1 / abar[k]) * x - np.sqrt(1 / abar[k] - 1) * eps
        mean = (beta[k] * np.sqrt(abar_prev[k]) / (1 - abar[k])) * x0 \
            + ((1 - abar_prev[k]) * np.sqrt(1 - beta[k]) / (1 - abar[k])) * x
        frac = (v + 1) / 2
        log_var = frac * np.log(beta[k]) + (1 - frac) * post_log_var_clipped[k]
        x = mean + (np.exp(0.5 * log_var) * noise.next().double().numpy() if k > 0 else 0)
    np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-5)
    assert [ts[0] for ts in toy.seen_t[:3]] == [999, 500, 0]  # the model sees original timesteps


class ExactGaussianDenoiser(torch.nn.Module):
    """The exact epsilon-prediction for data N(+-MU, S^2) (class 1: +MU, class 0: -MU): every correct
    sampler must return samples with about that mean and spread."""

    num_classes, in_channels, input_size = 2, 1, 4
    MU, S = 0.5, 0.5

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(()))
        self.abar = torch.from_numpy(np.cumprod(1 - np.linspace(1e-4, 0.02, 1000)))

    def forward(self, x, t, y):
        a = self.abar[t].float().reshape(-1, 1, 1, 1)
        mu = self.MU * (2 * y.float() - 1).reshape(-1, 1, 1, 1)
        # x_t ~ N(sqrt(a) mu, a S^2 + 1 - a), so E[eps | x_t] = sqrt(1 - a) (x_t - sqrt(a) mu) / (a S^2 + 1 - a).
        eps = (1 - a).sqrt() * (x - a.sqrt() * mu) / (a * self.S ** 2 + 1 - a)
        return torch.cat([eps, -torch.ones_like(x)], dim=1)  # v = -1: the posterior variance


@pytest.mark.parametrize("sampler,steps", [("ddpm", 100), ("ddim", 50), ("dpm-solver", 25)])
def test_samplers_recover_gaussian_data_from_the_exact_denoiser(sampler, steps):
    labels = np.arange(200) % 2
    x = sample_latents(ExactGaussianDenoiser(), DIFFUSION, labels, sampler=sampler, steps=steps, seed=1)
    for c, sign in ((0, -1), (1, 1)):
        values = x[torch.from_numpy(labels) == c]
        assert abs(values.mean().item() - sign * 0.5) < 0.03
        assert 0.44 < values.std().item() < 0.53


def test_respaced_timesteps_match_adm_for_250_of_1000():
    diffusion = respaced_diffusion(DIFFUSION, 250)
    stride = 999 / 249  # ADM: (section size - 1) / (count - 1), positions rounded
    expected = [round(k * stride) for k in range(250)]
    assert diffusion.timestep_map.tolist() == expected
    assert expected[:4] == [0, 4, 8, 12] and expected[-1] == 999
    full = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    np.testing.assert_allclose(diffusion.alphas_cumprod, full[expected], rtol=1e-12)


# -- latent models ----------------------------------------------------------------------------
def test_latent_model_decodes_through_a_local_vae(tmp_path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=8).eval()
    vae.save_pretrained(tmp_path / "vae")
    kwargs = {**TINY, "input_size": 4, "in_channels": 4}
    model = random_model(**kwargs)
    data = dict(kind="latents", image_size=8, image_channels=4, num_classes=10, vae=str(tmp_path / "vae"),
                scaling_factor=0.5)
    ckpt = write_ckpt(tmp_path / "ckpt", model, kwargs, data)
    run_sample("--ckpt", str(ckpt), "--num-samples", "3", "--steps", "4", "--sampler", "ddim",
               "--out", str(tmp_path / "lat.npz"))
    with np.load(tmp_path / "lat.npz") as f:
        images = f["arr_0"]
    assert images.dtype == np.uint8 and images.shape == (3, 8, 8, 3)
    # Same as decoding the latents by hand: z / scaling_factor through the VAE, [-1, 1] -> uint8.
    z = sample_latents(model, DIFFUSION, [0, 1, 2], steps=4, sampler="ddim", guidance=Guidance(1.5))
    with torch.no_grad():
        pixels = vae.decode(z / 0.5).sample
    expected = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1
    # The VAE folder gone -> one clear line.
    with pytest.raises(UserError, match="--vae"):
        run_sample("--ckpt", str(ckpt), "--num-samples", "1", "--out", str(tmp_path / "x.npz"),
                   "--vae", str(tmp_path / "missing"))
    write_ckpt(tmp_path / "novae", model, kwargs, {**data, "vae": None})
    with pytest.raises(UserError, match="names no VAE; pass --vae DIR"):
        run_sample("--ckpt", str(tmp_path / "novae"), "--num-samples", "1", "--out", str(tmp_path / "x.npz"))


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_bad_input_gives_one_clear_line(digits_ckpt, tmp_path):
    out = str(tmp_path / "bad.npz")
    with pytest.raises(UserError, match="out of range.*0..9"):
        run_sample("--ckpt", str(digits_ckpt), "--classes", "3,10", "--out", out)
    with pytest.raises(UserError, match="out of range"):
        sample_images(random_model(), DIFFUSION, [12])
    with pytest.raises(UserError, match="no unconditional mode"):
        sample_images(random_model(class_dropout_prob=0.0), DIFFUSION, [1], guidance=Guidance(2.0))
    # A checkpoint whose weights belong to another model.
    other = write_ckpt(tmp_path / "other", random_model(hidden_size=64), {**TINY, "hidden_size": 64})
    spec_path = other / "model_spec.json"
    spec_path.write_text(spec_path.read_text().replace('"hidden_size": 64', '"hidden_size": 32'))
    with pytest.raises(ValueError, match="does not fit this model"):
        run_sample("--ckpt", str(other), "--out", out)
    # Through the real command line: a negative scale is one line on stderr, exit 2.
    proc = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(digits_ckpt), "--cfg-scale", "-1",
                           "--out", out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: --cfg-scale -1.0 is negative")


def test_guidance_errors_name_the_value_and_the_sampling_job_names_its_flags():
    """Guidance serves sample.py, the training grids and the evaluations: its errors say what the value
    is; the sampling job checks the same rules under the flags the user typed."""
    cases = [(dict(scale=-1.0), "guidance scale -1.0 is negative", "--cfg-scale -1.0 is negative"),
             (dict(channels=0), "guided channels 0 must be at least 1", "--cfg-channels 0 must be at least 1"),
             (dict(interval=(0.0, 700.0)), "guidance interval 0,700 must lie in [0, 1]",
              "--guidance-interval 0,700 must lie in [0, 1]")]
    flags = {"scale": "cfg_scale", "channels": "cfg_channels", "interval": "guidance_interval"}
    for given, library, command in cases:
        with pytest.raises(UserError) as err:
            Guidance(**given)
        assert str(err.value).startswith(library) and "--" not in str(err.value)
        (key, value), = given.items()
        settings = job_module.JobSettings(ckpt="ckpt", out="o.npz", num_samples=1, **{flags[key]: value})
        with pytest.raises(UserError) as err:
            job_module.check_settings(settings)
        assert str(err.value).startswith(command)
    with pytest.raises(UserError, match="no unconditional mode for guidance") as err:
        GuidedDenoiser(tiny_model("cascaded", class_dropout_prob=0.0), Guidance(2.0))
    assert "--" not in str(err.value)


def test_one_ancestral_step_is_refused_in_one_line_and_ddim_takes_it(digits_ckpt, tmp_path):
    with pytest.raises(UserError, match="--steps 1: the ddpm sampler needs at least 2 steps"):
        run_sample("--ckpt", str(digits_ckpt), "--sampler", "ddpm", "--steps", "1", "--out", str(tmp_path / "a.npz"))
    assert not (tmp_path / "a.npz").exists()
    run_sample("--ckpt", str(digits_ckpt), "--sampler", "ddim", "--steps", "1", "--num-samples", "2",
               "--out", str(tmp_path / "b.npz"))
    assert np.load(tmp_path / "b.npz")["arr_0"].shape[0] == 2
