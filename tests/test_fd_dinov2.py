"""FD-DINOv2 with a tiny random timm ViT standing in for DINOv2 ViT-L/14 (same code path: a local
timm weights file, EDM2's preprocessing, the CLS token)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ancre_dit.data.adm_npz import save_adm_npz
from ancre_dit.errors import UserError
from ancre_dit.evaluation.metrics import feature_statistics, frechet_distance
from ancre_dit.evaluation.pipeline import evaluate

TINY_VIT = "vit_tiny_patch16_224"  # 5.7M parameters, 192-d CLS


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    import timm

    torch.manual_seed(0)
    net = timm.create_model(TINY_VIT, pretrained=False, num_classes=0).eval()
    path = tmp_path_factory.mktemp("vit") / "tiny_vit.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return path, net


def _images(seed: int, n: int = 6, size: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (1, size, size, 3))
    return np.clip(base + rng.integers(-60, 60, (n, size, size, 3)), 0, 255).astype(np.uint8)


def _direct_features(net: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    """EDM2's recipe written out: [0, 1], bicubic antialiased resize to 224, ImageNet mean / std, CLS."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double().div(255).float()
    x = F.interpolate(x, size=(224, 224), mode="bicubic", antialias=True)
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        return net(x).double().numpy()  # num_classes=0: the head returns the normed CLS token


@pytest.mark.slow
def test_fd_dinov2_matches_a_direct_computation_and_is_zero_against_itself(vit, tmp_path):
    weights, net = vit
    a, b = _images(1), _images(2)
    save_adm_npz(tmp_path / "a.npz", a, None)
    save_adm_npz(tmp_path / "b.npz", b, None)
    kw = dict(dinov2_weights=weights, dinov2_model=TINY_VIT, device="cpu", batch_size=4)
    got = evaluate(tmp_path / "a.npz", tmp_path / "b.npz", None, metrics="fd_dinov2", fid_method="eigh", **kw)
    fa, fb = _direct_features(net, a), _direct_features(net, b)
    expected = frechet_distance(*feature_statistics(fa), *feature_statistics(fb), method="eigh")
    assert got.metrics["fd_dinov2"] == pytest.approx(expected, rel=1e-5)
    assert got.metrics["fd_dinov2"] > 1e-3 * np.trace(feature_statistics(fa)[1])  # the sets differ
    assert got.info["dinov2_model"] == TINY_VIT and got.info["dinov2_reference_statistics"] == "features"
    same = evaluate(tmp_path / "a.npz", tmp_path / "a.npz", None, metrics="fd_dinov2", fid_method="eigh", **kw)
    assert abs(same.metrics["fd_dinov2"]) < 1e-6 * np.trace(feature_statistics(fa)[1])
    # Stored reference statistics (what --save-ref-stats writes) give the same number.
    mu, sigma = feature_statistics(fb)
    save_adm_npz(tmp_path / "stats.npz", None, None, mu_dinov2=mu, sigma_dinov2=sigma)
    stored = evaluate(tmp_path / "a.npz", tmp_path / "stats.npz", None, metrics="fd_dinov2", fid_method="eigh", **kw)
    assert stored.metrics["fd_dinov2"] == pytest.approx(expected, rel=1e-4)
    assert stored.info["dinov2_reference_statistics"] == "stored"


def test_fd_dinov2_bad_weights_are_one_line(vit, tmp_path):
    weights, _ = vit
    save_adm_npz(tmp_path / "a.npz", _images(1), None)
    with pytest.raises(UserError, match="--dinov2-weights .* does not exist"):
        evaluate(tmp_path / "a.npz", tmp_path / "a.npz", None, metrics="fd_dinov2",
                 dinov2_weights=tmp_path / "none.pth", dinov2_model=TINY_VIT, device="cpu")
    with pytest.raises(UserError, match="does not hold the weights of --dinov2-model vit_small_patch16_224"):
        evaluate(tmp_path / "a.npz", tmp_path / "a.npz", None, metrics="fd_dinov2", dinov2_weights=weights,
                 dinov2_model="vit_small_patch16_224", device="cpu")


@pytest.mark.slow
def test_fd_dinov2_during_training_equals_the_offline_pipeline(vit, tmp_path):
    """eval.metrics=[fd_dinov2] in training gives the number of sample.py + evaluate.py on the same
    checkpoint, seed and sampler."""
    from helpers import ROOT, accelerate_state, load_script, tiny_config

    from ancre_dit.data.adm_npz import to_uint8
    from ancre_dit.data.digits import DigitsDataset
    from ancre_dit.training.run_evaluation import read_evals
    from ancre_dit.training import train

    weights, _ = vit
    held = DigitsDataset("heldout")
    ref = save_adm_npz(tmp_path / "ref.npz", to_uint8(held.images[:10]).transpose(0, 2, 3, 1), held.labels[:10].numpy())
    run = tmp_path / "run"
    with accelerate_state():
        train(tiny_config(run, "train.max_steps=2", "train.ckpt_every=2", "train.eval_every=2", "eval.num_samples=8",
                          "eval.batch_size=4", "eval.sampler=ddpm", "eval.steps=3", "eval.cfg_scales=[1.5]",
                          "eval.heldout_loss=false", "eval.metrics=[fd_dinov2]", f"eval.ref={ref}",
                          f"eval.dinov2_weights={weights}", f"eval.dinov2_model={TINY_VIT}"))
    (entry,) = read_evals(run)
    assert set(entry["metrics"]) == {"fd_dinov2/cfg1.5"}
    samples = tmp_path / "samples.npz"
    with accelerate_state():
        load_script(ROOT / "sample.py").main(["--ckpt", str(run / "checkpoints" / "0000002"), "--num-samples", "8",
                                              "--batch-size", "4", "--sampler", "ddpm", "--steps", "3",
                                              "--cfg-scale", "1.5", "--seed", "0", "--out", str(samples), "--cpu"])
    offline = evaluate(samples, ref, None, metrics="fd_dinov2", fid_method="eigh", device="cpu",
                       dinov2_weights=weights, dinov2_model=TINY_VIT).metrics
    assert entry["metrics"]["fd_dinov2/cfg1.5"] == pytest.approx(offline["fd_dinov2"], rel=1e-5)


@pytest.mark.slow
def test_save_ref_stats_stores_dinov2_statistics_of_the_folder(vit, tmp_path):
    from PIL import Image

    from ancre_dit.evaluation import write_random_inception_weights
    from ancre_dit.evaluation.pipeline import save_reference_stats

    weights, _ = vit
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, image in enumerate(_images(3, n=5)):
        Image.fromarray(image).save(folder / f"{i}.png")
    save_adm_npz(tmp_path / "a.npz", _images(1), None)
    inception = write_random_inception_weights(tmp_path / "inception.pth")
    ref = save_reference_stats(folder, tmp_path / "ref.npz", inception, image_size=40, dinov2_weights=weights,
                               dinov2_model=TINY_VIT, device="cpu")
    kw = dict(dinov2_weights=weights, dinov2_model=TINY_VIT, device="cpu", fid_method="eigh")
    stored = evaluate(tmp_path / "a.npz", ref, None, metrics="fd_dinov2", **kw)
    direct = evaluate(tmp_path / "a.npz", folder, None, metrics="fd_dinov2", **kw)
    assert stored.info["dinov2_reference_statistics"] == "stored"
    assert stored.metrics["fd_dinov2"] == pytest.approx(direct.metrics["fd_dinov2"], rel=1e-6)
