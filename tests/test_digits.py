"""The embedded digits data set, and a tiny DiT whose held-out diffusion loss falls on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model
from sklearn.datasets import load_digits

from ancre_dit.data.adm_npz import to_uint8
from ancre_dit.data.digits import DIGITS_IMAGE_SIZE, DIGITS_NUM_CLASSES, HELDOUT_INDICES, DigitsDataset
from ancre_dit.diffusion.gaussian import create_diffusion


def test_splits_shapes_ranges_and_disjointness():
    train, heldout = DigitsDataset("train"), DigitsDataset("heldout")
    assert len(train) + len(heldout) == 1797
    assert 170 <= len(heldout) <= 190  # ~10%
    assert set(train.indices.tolist()).isdisjoint(heldout.indices.tolist())
    image, label = train[0]
    assert image.shape == (1, DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE) and image.dtype == torch.float32
    assert isinstance(label, int) and 0 <= label < DIGITS_NUM_CLASSES
    for split in (train, heldout):
        assert split.images.min().item() == -1.0 and split.images.max().item() == 1.0
        # stratified: every class is in the held-out split in about its share
        counts = torch.bincount(split.labels, minlength=DIGITS_NUM_CLASSES)
        assert counts.min().item() > 0.08 * len(split)
    # pixel values 0..16 map linearly to [-1, 1]
    raw = load_digits()
    i = int(heldout.indices[3])
    np.testing.assert_allclose(heldout.images[3, 0].numpy(), raw.images[i] / 8.0 - 1.0, atol=1e-6)
    assert heldout.labels[3].item() == raw.target[i]


def test_split_is_fixed():
    first, second = DigitsDataset("heldout"), DigitsDataset("heldout")
    assert torch.equal(first.images, second.images)
    # a change of the seeded split would change every held-out number ever reported
    assert first.indices[:5].tolist() == [24, 28, 35, 37, 39]


def test_the_data_and_the_split_are_scikit_learns():
    """The digits are read from scikit-learn's file without importing it, and the held-out split is
    written out: both must be what load_digits and the seeded stratified split give."""
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    _, heldout = train_test_split(np.arange(len(raw.target)), test_size=0.1, random_state=0, stratify=raw.target)
    assert sorted(heldout.tolist()) == list(HELDOUT_INDICES)
    train, held = DigitsDataset("train"), DigitsDataset("heldout")
    assert held.indices.tolist() == list(HELDOUT_INDICES)
    assert sorted(train.indices.tolist() + held.indices.tolist()) == list(range(len(raw.target)))
    for ds in (train, held):
        assert torch.equal(ds.images[:, 0], torch.from_numpy(raw.images.astype(np.float32)[ds.indices] / 16.0 * 2.0 - 1.0))
        assert ds.labels.tolist() == raw.target[ds.indices].tolist()


def test_unknown_split_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown digits split 'test'; choose one of train, heldout"):
        DigitsDataset("test")


def test_to_uint8():
    out = to_uint8(torch.tensor([-1.5, -1.0, 0.0, 1.0, 2.0]))
    assert out.dtype == np.uint8 and out.tolist() == [0, 0, 128, 255, 255]


@pytest.mark.slow
def test_tiny_dit_loss_falls_on_digits(one_thread):
    train, heldout = DigitsDataset("train"), DigitsDataset("heldout")
    model = tiny_model("ancre", seed=0, hidden_size=64, learn_sigma=True)
    # positional embeddings are what lets the model place strokes: they must be set and distinct
    assert torch.unique(model.pos_embed[0], dim=0).shape[0] == model.x_embedder.num_patches
    diffusion = create_diffusion(learn_sigma=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    generator = torch.Generator().manual_seed(1)
    x_eval = heldout.images.repeat(3, 1, 1, 1)
    y_eval = heldout.labels.repeat(3)
    t_eval = torch.tensor([100, 400, 700]).repeat_interleave(len(heldout))
    noise_eval = torch.randn(x_eval.shape, generator=generator)

    @torch.no_grad()
    def heldout_loss() -> float:
        model.eval()
        loss = diffusion.training_losses(model, x_eval, t_eval, {"y": y_eval}, noise=noise_eval)["mse"].mean()
        model.train()
        return loss.item()

    before = heldout_loss()
    for _ in range(200):
        idx = torch.randint(0, len(train), (64,), generator=generator)
        t = torch.randint(0, 1000, (64,), generator=generator)
        loss = diffusion.training_losses(model, train.images[idx], t, {"y": train.labels[idx]},
                                         noise=torch.randn(64, 1, 8, 8, generator=generator))["loss"].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = heldout_loss()
    # adaLN-Zero starts at eps = 0 (MSE ~1); 200 steps already predict a large part of the noise
    assert before > 0.9
    assert after < 0.5 * before, (before, after)
    assert model.topology.logits[1].grad is not None  # the topology is being trained too


def test_sample_grid_png_holds_the_images(tmp_path):
    from PIL import Image

    from ancre_dit.figures import save_image_grid

    images = DigitsDataset("heldout").images[:10]
    nhwc = np.repeat(to_uint8(images).transpose(0, 2, 3, 1), 3, axis=-1)  # the ADM sample layout
    for name, batch in (("uint8.png", nhwc), ("float.png", images)):
        path = save_image_grid(batch, tmp_path / name, nrow=5, scale=1)
        grid = np.asarray(Image.open(path).convert("L"))
        assert grid.shape == (2 * 9 + 1, 5 * 9 + 1)  # 2 rows x 5 columns of 8x8, 1-pixel padding
        np.testing.assert_allclose(grid[1:9, 1:9], nhwc[0, :, :, 0], atol=1)
        np.testing.assert_allclose(grid[10:18, 37:45], nhwc[9, :, :, 0], atol=1)
    with pytest.raises(ValueError, match="4-D batch"):
        save_image_grid(images[0], tmp_path / "bad.png")


@pytest.mark.parametrize("count, channels, nrow", [(10, 1, 5), (7, 3, 3), (3, 3, 8), (40, 1, 8)])
def test_sample_grid_png_is_torchvisions(tmp_path, count, channels, nrow):
    """The grid is torchvision's make_grid + save_image pixel for pixel: padding, grey as RGB, an
    unfilled last row, the upscale of small images."""
    from PIL import Image
    from torchvision.utils import make_grid, save_image

    from ancre_dit.figures import save_image_grid

    images = torch.rand(count, channels, 8, 8, generator=torch.Generator().manual_seed(count)) * 2 - 1
    ours = np.asarray(Image.open(save_image_grid(images, tmp_path / "ours.png", nrow=nrow)))
    upscaled = torch.nn.functional.interpolate((images + 1) / 2, scale_factor=8, mode="nearest")
    save_image(make_grid(upscaled, nrow=nrow, padding=8, pad_value=0.5), str(tmp_path / "theirs.png"))
    np.testing.assert_array_equal(ours, np.asarray(Image.open(tmp_path / "theirs.png")))


def test_topology_summary_and_heatmap(tmp_path):
    from PIL import Image

    from ancre_dit.figures import plot_topology_heatmap
    from ancre_dit.models.topologies.analysis import topology_summary

    P = torch.tensor([[1.0, 0, 0, 0], [0.7, 0.3, 0, 0], [0.1, 0.6, 0.3, 0], [0.5, 0.1, 0.1, 0.3]])
    summary = topology_summary(P)
    blocks = summary["blocks"]
    assert [b["strongest_source"] for b in blocks] == [0, 0, 1, 0]
    assert [b["anchor_weight"] for b in blocks] == pytest.approx([1.0, 1.0, 0.7, 0.6])
    assert [b["previous_weight"] for b in blocks] == pytest.approx([1.0, 0.3, 0.3, 0.3])
    assert blocks[1]["entropy"] == pytest.approx(-(0.7 * np.log(0.7) + 0.3 * np.log(0.3)))
    assert blocks[0]["normalized_entropy"] == 0.0
    assert summary["mean_anchor_weight_deep"] == pytest.approx(0.65)
    assert summary["anchor_strongest_fraction_deep"] == pytest.approx(1.0)
    path = plot_topology_heatmap(P, tmp_path / "sub" / "heatmap.png", title="test")
    assert Image.open(path).size[0] > 100
    with pytest.raises(ValueError, match="square"):
        topology_summary(torch.ones(2, 3))
