"""Evaluation: ADM-definition metrics, the Inception pipeline (random weights written here), the
reference writer, the weights errors, the CLI and the offline digits check."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import linalg

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.data.adm_npz import ADMBatch, load_adm_npz, save_adm_npz
from ancre_dit.evaluation import (
    WEIGHTS_NAME, InceptionExtractor, check_weights, compute_metrics, digits_report, evaluate,
    feature_statistics, format_digits_report, frechet_distance, frechet_distance_to_features, inception_score, precision_recall,
    save_reference_stats, write_random_inception_weights,
)
from ancre_dit.evaluation.inception import iterate_batches
from ancre_dit.evaluation.pipeline import open_adm_npz

ROOT = Path(__file__).resolve().parents[1]
N, SIZE = 12, 32  # few, small images: the network resizes to 299 and costs ~0.1 s per image on a CPU


def _blobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """Smooth random colour fields (bicubic upsampling of 4x4 noise), uint8 (n, SIZE, SIZE, 3)."""
    low = torch.tensor(rng.uniform(0, 255, (n, 3, 4, 4)))
    x = torch.nn.functional.interpolate(low, size=(SIZE, SIZE), mode="bicubic", align_corners=False)
    return x.permute(0, 2, 3, 1).clamp(0, 255).round().numpy().astype(np.uint8)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return write_random_inception_weights(tmp_path_factory.mktemp("inception") / WEIGHTS_NAME, seed=0)


@pytest.fixture(scope="module")
def image_sets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    real = _blobs(rng, N)
    return {
        "real": real,
        "noised": np.clip(real + rng.normal(0, 60, real.shape), 0, 255).astype(np.uint8),
        "shifted": np.clip(real.astype(np.int64) + 40, 0, 255).astype(np.uint8),
    }


@pytest.fixture(scope="module")
def extractor(weights) -> InceptionExtractor:
    return InceptionExtractor(weights, device="cpu")


@pytest.fixture(scope="module")
def features(extractor, image_sets):
    return {k: extractor.extract(iterate_batches(v, 8), total=len(v)) for k, v in image_sets.items()}


# --- metric definitions on small feature sets -------------------------------------------------

def _direct_fid(a: np.ndarray, b: np.ndarray) -> float:
    """Textbook FID straight from numpy/scipy, independent of our code path."""
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(linalg.sqrtm(s1 @ s2)).real)


def test_fid_equals_direct_scipy_and_torch_fidelity():
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(1)
    a = rng.normal(size=(300, 12))
    b = rng.normal(size=(250, 12)) @ rng.normal(size=(12, 12)) * 0.5 + 0.3
    direct = _direct_fid(a, b)
    stats_a, stats_b = feature_statistics(a), feature_statistics(b)
    tf = fid_statistics_to_metric({"mu": stats_a[0], "sigma": stats_a[1]},
                                  {"mu": stats_b[0], "sigma": stats_b[1]}, verbose=False)["frechet_inception_distance"]
    for method in ("sqrtm", "eigh"):
        ours = frechet_distance(*stats_a, *stats_b, method=method)
        assert ours == pytest.approx(direct, rel=1e-9)
        assert ours == pytest.approx(tf, rel=1e-7)
    assert frechet_distance(*stats_a, *stats_a, method="eigh") == pytest.approx(0.0, abs=1e-9)
    # Fewer samples than dimensions (singular covariances): the eigh path stays finite and agrees
    # with torch-fidelity's eigenvalue formula.
    c, d = rng.normal(size=(8, 20)), rng.normal(size=(9, 20)) + 0.1
    sc, sd = feature_statistics(c), feature_statistics(d)
    tf_small = fid_statistics_to_metric({"mu": sc[0], "sigma": sc[1]}, {"mu": sd[0], "sigma": sd[1]},
                                        verbose=False)["frechet_inception_distance"]
    assert frechet_distance(*sc, *sd, method="eigh") == pytest.approx(tf_small, rel=1e-6)
    # ... and so does the N-dim route from raw features (N < D).
    assert frechet_distance_to_features(c, *sd) == pytest.approx(tf_small, rel=1e-6)
    assert frechet_distance_to_features(a, *stats_b) == pytest.approx(direct, rel=1e-9)
    with pytest.raises(ValueError, match="do not match"):
        frechet_distance(sc[0], sc[1], stats_a[0], stats_a[1])


def _brute_force_pr(real: np.ndarray, fake: np.ndarray, k: int) -> tuple[float, float]:
    def radii(x):  # distance to the k-th neighbour, self counted as the 0th
        d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
        return np.sort(d, axis=1)[:, k]

    d_fr = np.sqrt(((fake[:, None] - real[None]) ** 2).sum(-1))  # (n_fake, n_real)
    precision = np.mean([(d_fr[i] <= radii(real)).any() for i in range(len(fake))])
    recall = np.mean([(d_fr[:, j] <= radii(fake)).any() for j in range(len(real))])
    return float(precision), float(recall)


def test_precision_recall_equals_brute_force_knn():
    from torch_fidelity.metric_prc import calculate_precision_recall_full

    rng = np.random.default_rng(2)
    real = rng.normal(size=(41, 6))
    fake = rng.normal(size=(37, 6)) * 0.6 + 0.8  # narrower and shifted: some of each side uncovered
    nontrivial = []
    for k in (1, 3, 5):
        expected = _brute_force_pr(real, fake, k)
        # Small blocks exercise the row x column batching.
        assert precision_recall(real, fake, k=k, batch_size=7, dtype=torch.float64) == pytest.approx(expected)
        assert precision_recall(real, fake, k=k) == pytest.approx(expected)
        tf = calculate_precision_recall_full(torch.tensor(fake), torch.tensor(real), neighborhood=k)
        assert tf == pytest.approx(expected)
        nontrivial.append(0 < expected[0] < 1 and 0 < expected[1] < 1)
    assert nontrivial[1]  # k = 3 is not a degenerate 0 / 1 case
    assert precision_recall(real, real) == (1.0, 1.0)
    with pytest.raises(ValueError, match="more than 3"):
        precision_recall(real[:3], fake)


def test_inception_score_adm_splits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(12, 10)) * 3

    def direct(part):
        p = np.exp(part - part.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        return np.exp(np.mean(np.sum(p * (np.log(p) - np.log(p.mean(0, keepdims=True))), 1)))

    # Consecutive splits of 5 (the last one smaller, as in ADM), averaged.
    expected = np.mean([direct(logits[0:5]), direct(logits[5:10]), direct(logits[10:12])])
    assert inception_score(logits, split_size=5) == pytest.approx(expected, rel=1e-10)
    assert inception_score(np.tile(logits[:1], (7, 1))) == pytest.approx(1.0, abs=1e-12)


# --- Inception features ------------------------------------------------------------------------

@pytest.mark.slow
def test_features_are_adm_layers(extractor, image_sets, features):
    f = features["real"]
    assert f.pool.shape == (N, 2048) and f.spatial.shape == (N, 7 * 17 * 17) and f.logits.shape == (N, 1008)
    # logits_unbiased = pool_3 @ W (no bias), as ADM's IS softmax.
    w = extractor.model.fc.weight.detach().double().numpy()
    np.testing.assert_allclose(f.logits, f.pool.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    # Spatial = mixed_6/conv (torch-fidelity's Mixed_6d.branch1x1 output) [..., :7] flattened as (H, W, C).
    seen = []
    hook = extractor.model.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
    try:
        _, spatial, _ = extractor.batch(image_sets["real"][:2])
    finally:
        hook.remove()
    nhwc = seen[0].permute(0, 2, 3, 1)[..., :7]
    assert torch.equal(spatial.reshape(2, 17, 17, 7), nhwc)
    np.testing.assert_allclose(spatial.numpy(), f.spatial[:2], rtol=1e-5, atol=1e-6)  # batching-independent


@pytest.mark.slow
def test_noise_and_shift_move_fid_up_and_precision_recall_down(features):
    real = features["real"]

    def fid(other, kind="pool"):  # N < D: the exact N-dim route keeps this fast on a CPU
        return frechet_distance_to_features(getattr(other, kind), *feature_statistics(getattr(real, kind)))

    assert abs(fid(real)) < 1e-4
    for name in ("noised", "shifted"):
        other = features[name]
        assert fid(other) > 1.0
        assert fid(other, "spatial") > 0.1
        precision, recall = precision_recall(real.pool, other.pool)
        assert precision < 1.0 and recall <= 1.0 and precision + recall < 2.0
    assert precision_recall(real.pool, features["noised"].pool)[1] < 0.5  # noise covers little of the real set


# --- the pipeline: npz / folder / statistics-only references -------------------------------------

@pytest.mark.slow
def test_fid_of_a_set_against_itself_image_path(weights, image_sets, tmp_path):
    path = save_adm_npz(tmp_path / "real.npz", image_sets["real"], np.arange(N) % 10)
    out = compute_metrics(path, path, weights, metrics=("fid", "sfid", "precision", "recall", "kid"),
                          device="cpu", fid_method="eigh")
    assert abs(out["fid"]) < 1e-4 and abs(out["sfid"]) < 1e-4
    assert out["precision"] == 1.0 and out["recall"] == 1.0
    assert abs(out["kid"]) < 1e-3 and "kid_std" in out


@pytest.mark.slow
def test_reference_stats_from_folder_and_mu_sigma_path(weights, image_sets, features, tmp_path):
    folder = tmp_path / "images"
    for i, image in enumerate(image_sets["real"]):  # two class subfolders -> labels 0 / 1
        (folder / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"class{i % 2}" / f"{i:03d}.png")
    ref = save_reference_stats(folder, tmp_path / "ref.npz", weights, image_size=SIZE, with_images=True, device="cpu")
    batch = load_adm_npz(ref)
    assert batch.stats["mu"].shape == (2048,) and batch.stats["sigma"].shape == (2048, 2048)
    assert batch.stats["mu_s"].shape == (2023,) and batch.stats["sigma_s"].shape == (2023, 2023)
    order = sorted(range(N), key=lambda i: (i % 2, i))  # files sorted by class folder, then name
    np.testing.assert_array_equal(batch.images, image_sets["real"][order])  # same-size crop is the identity
    np.testing.assert_array_equal(batch.labels, [i % 2 for i in order])
    mu, sigma = feature_statistics(features["real"].pool)
    np.testing.assert_allclose(batch.stats["mu"], mu, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(batch.stats["sigma"], sigma, rtol=1e-3, atol=1e-7)

    stats_only = save_adm_npz(tmp_path / "stats.npz", None, **batch.stats)
    samples = ADMBatch(image_sets["real"], None)
    result = evaluate(samples, stats_only, weights, metrics="fid,sfid", device="cpu", fid_method="eigh")
    assert abs(result.metrics["fid"]) < 1e-4 and abs(result.metrics["sfid"]) < 1e-4
    assert result.info["reference_statistics"] == "stored" and result.info["num_reference_images"] == 0
    shifted = compute_metrics(ADMBatch(image_sets["shifted"][:6], None), stats_only, weights, metrics=("fid",),
                              device="cpu", fid_method="eigh")
    assert shifted["fid"] > 1.0
    with pytest.raises(ValueError, match="statistics only"):
        compute_metrics(samples, stats_only, weights, metrics=("precision",), device="cpu")


@pytest.mark.slow
def test_is_of_one_repeated_image_is_one(weights, image_sets, features):
    repeated = ADMBatch(np.repeat(image_sets["real"][:1], 6, axis=0), None)
    out = compute_metrics(repeated, None, weights, metrics=("is",), device="cpu")
    assert out["is"] == pytest.approx(1.0, abs=1e-5)
    assert inception_score(features["real"].logits) > 1.0 + 1e-3  # distinct images do score higher


# --- files: the ADM npz, weights errors, the CLI ---------------------------------------------------

def test_adm_npz_round_trip_and_lazy_reader(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (5, 6, 6, 3), dtype=np.uint8)
    labels = np.arange(5)
    stats = {"mu": rng.normal(size=3), "sigma": np.eye(3), "mu_s": rng.normal(size=2), "sigma_s": np.eye(2)}
    path = save_adm_npz(tmp_path / "s.npz", images, labels, **stats)
    for reader in (load_adm_npz, open_adm_npz):
        batch = reader(path)
        np.testing.assert_array_equal(batch.images, images)
        np.testing.assert_array_equal(batch.labels, labels)
        for k, v in stats.items():
            np.testing.assert_array_equal(batch.stats[k], v)
    assert isinstance(open_adm_npz(path).images, np.memmap)  # 50K samples are not read into memory
    gray = save_adm_npz(tmp_path / "g.npz", images[..., 0])
    np.testing.assert_array_equal(open_adm_npz(gray).images[..., 2], images[..., 0])
    np.savez_compressed(tmp_path / "c.npz", arr_0=images)  # compressed: falls back to a full read
    np.testing.assert_array_equal(open_adm_npz(tmp_path / "c.npz").images, images)
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable ADM"):
        open_adm_npz(tmp_path / "broken.npz")


@pytest.mark.slow
def test_missing_or_corrupt_weights_give_one_line(weights, tmp_path):
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x00garbage" * 10)
    wrong = tmp_path / "wrong.pth"
    torch.save({"fc.weight": torch.zeros(3, 3)}, wrong)
    truncated = tmp_path / "truncated.pth"  # right landmarks, a layer missing: the strict load catches it
    state = torch.load(weights, weights_only=True)
    del state["Mixed_7c.branch_pool.conv.weight"]
    torch.save(state, truncated)
    cases = [(check_weights, tmp_path / "missing.pth"), (check_weights, corrupt), (check_weights, wrong),
             (check_weights, None), (lambda p: InceptionExtractor(p, device="cpu"), truncated)]
    for load, path in cases:
        with pytest.raises(UserError) as err:
            load(path)
        message = str(err.value)
        assert WEIGHTS_NAME in message and "--inception-weights" in message and "\n" not in message


def _run_cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """Runs evaluate.py's main in this process (the network stays loaded) as the shell would."""
    main = runpy.run_path(str(ROOT / "evaluate.py"))["main"]
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.slow
def test_cli_writes_table_and_json_and_fails_in_one_line(weights, image_sets, tmp_path, monkeypatch, capsys):
    samples = save_adm_npz(tmp_path / "samples.npz", image_sets["real"][:6], np.arange(6))
    ref = save_adm_npz(tmp_path / "ref.npz", image_sets["shifted"][:6])
    out = tmp_path / "out.json"
    code, stdout, stderr = _run_cli(monkeypatch, capsys, "--samples", str(samples), "--ref", str(ref),
                                    "--inception-weights", str(weights), "--metrics", "fid,is,precision,recall",
                                    "--fid-method", "eigh", "--device", "cpu", "--json", str(out))
    assert code == 0, stderr
    assert "FID" in stdout and "Precision" in stdout
    data = json.loads(out.read_text())
    assert set(data["metrics"]) == {"fid", "is", "precision", "recall"} and data["metrics"]["fid"] > 0
    assert data["num_samples"] == 6 and data["reference"] == str(ref.resolve())
    assert data["inception_weights"] == str(Path(weights).resolve()) and len(data["inception_weights_sha256"]) == 64
    code, stdout, stderr = _run_cli(monkeypatch, capsys, "--samples", str(samples), "--ref", str(ref),
                                    "--inception-weights", str(tmp_path / "nope.pth"))
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and WEIGHTS_NAME in lines[0]


# --- the digits offline check ------------------------------------------------------------------

@pytest.mark.slow
def test_digits_report_real_high_noise_chance(tmp_path, monkeypatch, capsys):
    from ancre_dit.data.adm_npz import to_uint8
    from ancre_dit.data.digits import DigitsDataset

    heldout = DigitsDataset("heldout")
    images = to_uint8(heldout.images[:, 0])  # (N, 8, 8) uint8, as sample.py writes them
    labels = heldout.labels.numpy()
    real = digits_report(images, labels)
    assert real["accuracy"] > 0.95 and real["accuracy"] == pytest.approx(real["real_heldout_accuracy"])
    assert digits_report(np.repeat(images[..., None], 3, axis=-1), labels)["accuracy"] == real["accuracy"]
    noise = digits_report(np.random.default_rng(5).integers(0, 256, images.shape, dtype=np.uint8), labels)
    assert noise["accuracy"] < 0.25
    assert noise["pixel_fd"] > 5 * real["pixel_fd"]
    text = format_digits_report(real)
    assert "NOT FID-50K" in text and f"{real['accuracy']:.3f}" in text
    with pytest.raises(ValueError, match="uint8"):
        digits_report(images.astype(np.float32), labels)
    # The CLI face of it, for the quickstart.
    path = save_adm_npz(tmp_path / "digits.npz", images, labels)
    code, stdout, stderr = _run_cli(monkeypatch, capsys, "--samples", str(path), "--digits")
    assert code == 0, stderr
    assert "NOT FID-50K" in stdout


def test_evaluation_features_and_distances_run_in_full_fp32(monkeypatch):
    """configure_precision turns TF32 on for training and sampling; DINOv2's features and the
    precision / recall distances (as Inception's features) are computed without it."""
    import importlib

    import numpy as np

    from ancre_dit.evaluation.dinov2 import DinoV2Extractor

    pr = importlib.import_module("ancre_dit.evaluation.metrics")

    seen = []

    def flags():
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    real_distances = pr._squared_distances
    monkeypatch.setattr(pr, "_squared_distances", lambda a, b: (flags(), real_distances(a, b))[1])

    class Net(torch.nn.Module):
        def forward_features(self, x):
            flags()
            return torch.zeros(len(x), 2, 3)

    dinov2 = DinoV2Extractor.__new__(DinoV2Extractor)
    dinov2.net, dinov2.device = Net(), torch.device("cpu")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as configure_precision on CUDA
    try:
        rng = np.random.default_rng(0)
        pr.precision_recall(rng.random((12, 4)), rng.random((12, 4)), k=3)
        dinov2.batch(np.zeros((2, 8, 8, 3), dtype=np.uint8))
        after = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert len(seen) >= 3 and set(seen) == {(False, False)}
    assert after == (True, True)  # the caller's setting back
