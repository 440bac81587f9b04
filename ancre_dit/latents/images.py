"""The image side of latent extraction: an ImageFolder-style listing and tolerant loading + ADM crop."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from ancre_dit.errors import UserError
from ancre_dit.data.transforms import center_crop_arr


@dataclass
class ImageList:
    root: Path
    class_names: list[str]
    files: list[tuple[str, int]]  # (path relative to root, label), in ImageFolder's sorted order


def list_image_folder(root: str | os.PathLike) -> ImageList:
    """Lists an ImageNet-style folder exactly as torchvision's ImageFolder does (sorted class folders,
    label = class position, files sorted per folder), so labels and order match DiT's data."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--data-path {root} is not a folder; pass the ImageNet train folder (one subfolder per class)")
    try:
        class_names, class_to_idx = find_classes(root)
    except FileNotFoundError:
        raise UserError(f"--data-path {root} has no class subfolders; pass a folder holding one subfolder of images per class") from None
    samples = make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not samples:
        raise UserError(f"no images ({', '.join(IMG_EXTENSIONS)}) under {root}'s class folders; check --data-path")
    files = [(os.path.relpath(path, root), label) for path, label in samples]
    return ImageList(root, class_names, files)


@dataclass
class LoadedImage:
    position: int
    array: np.ndarray | None  # uint8 (S, S, 3) after the ADM crop, None when skipped
    action: str  # "ok", "converted" or "skipped"
    detail: str = ""


def load_and_crop(path: str | os.PathLike, image_size: int, min_side: int) -> tuple[np.ndarray | None, str, str]:
    """Opens one image, converts any mode to RGB and applies ADM's center crop.

    Returns (array or None, action, detail): a bad file is reported, never raised, so one broken
    JPEG cannot abort a long job.
    """
    try:
        with warnings.catch_warnings():
            # PIL warns (not raises) on EXIF oddities or large images; errors below still raise.
            warnings.simplefilter("ignore")
            with Image.open(path) as img:
                img.load()  # decode now: truncated or corrupt data raises here, not later
                mode = img.mode
                if min(img.size) < min_side:
                    return None, "skipped", f"too small ({img.size[0]}x{img.size[1]} < --min-side {min_side})"
                if mode != "RGB":
                    if mode == "P" and "transparency" in img.info:
                        img = img.convert("RGBA")  # PIL asks for this route for transparent palettes
                    img = img.convert("RGB")
                array = np.asarray(center_crop_arr(img, image_size), dtype=np.uint8)
    except Exception as err:  # noqa: BLE001 - any decoder failure means "skip this file"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return None, "skipped", f"unreadable ({type(err).__name__}: {reason})"
    if array.shape != (image_size, image_size, 3):
        return None, "skipped", f"crop gave shape {array.shape}"
    if mode != "RGB":
        return array, "converted", f"{mode} -> RGB"
    return array, "ok", ""


class CroppedImages(Dataset):
    """Positions of the sorted file list -> LoadedImage, for a DataLoader whose workers decode JPEGs."""

    def __init__(self, images: ImageList, image_size: int, min_side: int):
        self.images, self.image_size, self.min_side = images, image_size, min_side

    def __len__(self) -> int:
        return len(self.images.files)

    def __getitem__(self, position: int) -> LoadedImage:
        rel, _ = self.images.files[position]
        array, action, detail = load_and_crop(self.images.root / rel, self.image_size, self.min_side)
        return LoadedImage(position, array, action, detail)
