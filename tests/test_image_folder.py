"""The one image-folder reader (ancre_dit.data.image_folder): listing rule, conversion, ADM's crop."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from ancre_dit.data.image_folder import center_crop_arr, list_image_folder, load_rgb
from ancre_dit.errors import MissingFileError, UserError


def _save(path, size=(6, 4), value=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path)


def test_a_class_tree_is_listed_like_imagefolder(tmp_path):
    from torchvision.datasets import ImageFolder

    root = tmp_path / "tree"
    for rel in ("b/2.png", "b/10.PNG", "a/z.jpg", "a/sub/x.webp", "a-b/y.bmp", "c/k.pgm"):
        _save(root / rel)
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "empty").mkdir()
    # Training and extraction refuse a class no image teaches (as ImageFolder does by default);
    # a listing that needs no labels keeps it as a class, so the folders after it keep their labels.
    with pytest.raises(UserError, match=r"class folder .*/empty holds no images"):
        list_image_folder(root, require_classes=True)
    listing = list_image_folder(root)
    assert listing.class_names == ["a", "a-b", "b", "c", "empty"]
    assert listing.files == ["a/z.jpg", "a/sub/x.webp", "a-b/y.bmp", "b/10.PNG", "b/2.png", "c/k.pgm"]
    assert listing.labels == [0, 0, 1, 2, 2, 3]
    reference = ImageFolder(root, allow_empty=True)  # DiT's reader: same files, order and labels
    assert [(str(p), y) for p, y in zip(listing.paths(), listing.labels)] == reference.samples


def test_a_flat_folder_is_sorted_by_name_without_labels(tmp_path):
    for name in ("b.png", "a.JPEG", "c.tiff", "10.png"):
        _save(tmp_path / name)
    (tmp_path / "readme.md").write_text("ignored")
    (tmp_path / "empty").mkdir()  # a subfolder without images does not make it a class tree
    listing = list_image_folder(tmp_path)
    assert listing.files == ["10.png", "a.JPEG", "b.png", "c.tiff"]
    assert listing.labels is None and listing.class_names == []
    with pytest.raises(UserError, match="no class subfolders"):
        list_image_folder(tmp_path, require_classes=True)


def test_unclear_or_empty_folders_are_one_clear_error(tmp_path):
    _save(tmp_path / "top.png")
    _save(tmp_path / "cls" / "x.png")
    with pytest.raises(UserError, match="both directly .* and in subfolders"):
        list_image_folder(tmp_path)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(MissingFileError, match="no image files"):
        list_image_folder(tmp_path / "nothing")
    with pytest.raises(MissingFileError, match="not a folder"):
        list_image_folder(tmp_path / "missing")


def test_images_become_rgb_and_get_adms_crop(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (37, 70, 3), dtype=np.uint8)
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "cmyk.jpg")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "gray.png")
    assert load_rgb(tmp_path / "cmyk.jpg").shape == (37, 70, 3)
    gray = load_rgb(tmp_path / "gray.png")
    assert (gray == rgb[..., :1]).all()  # grayscale -> three equal channels
    # ADM's crop, written out: 70x37 -> box-halve to 35x18 (short side >= 2 * 8), then again to
    # 17x9, bicubic to 15x8 (round(17 * 8 / 9) = 15), keep columns 3..10.
    image = Image.fromarray(rgb)
    expected = np.asarray(image.resize((35, 18), Image.BOX).resize((17, 9), Image.BOX)
                          .resize((15, 8), Image.BICUBIC))[:, 3:11]
    np.testing.assert_array_equal(np.asarray(center_crop_arr(image, 8)), expected)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    np.testing.assert_array_equal(load_rgb(tmp_path / "rgb.png", 8), expected)


def test_symlinks_are_followed_to_each_real_folder_and_file_once(tmp_path):
    """A link back up the tree (a loop), a link into another class and a second link to one file
    would list images many times, some under another class's label."""
    import os

    root = tmp_path / "tree"
    for rel in ("a/0.png", "a/1.png", "b/0.png", "b/deep/2.png"):
        _save(root / rel)
    os.symlink("..", root / "a" / "loop")          # a -> tree -> a, b, ... about 40 levels deep
    os.symlink(root / "a", root / "b" / "to_a")     # a's images under b's label
    os.symlink(root / "b" / "0.png", root / "b" / "same.png")
    outside = tmp_path / "elsewhere"
    _save(outside / "3.png")
    os.symlink(outside, root / "b" / "linked")      # a real folder outside the tree is still read
    listing = list_image_folder(root, require_classes=True)
    assert listing.files == ["a/0.png", "a/1.png", "b/0.png", "b/deep/2.png", "b/linked/3.png"]
    assert listing.labels == [0, 0, 1, 1, 1]


def test_16_bit_greys_are_scaled_to_8_bits(tmp_path):
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1040).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as img:
        assert img.mode.startswith("I")  # the case at hand: PIL opens it as 16-bit integers
    rgb = load_rgb(tmp_path / "deep.png")
    assert rgb.shape == (8, 8, 3) and (rgb[..., 0] == rgb[..., 2]).all()
    assert np.array_equal(rgb[..., 0], (ramp.astype(np.int64) // 257).astype(np.uint8))  # not clipped at 255
