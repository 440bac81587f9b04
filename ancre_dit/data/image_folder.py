"""The one image-folder reader: how a folder is listed, how an image is opened, ADM's center crop.

Extraction, image-folder training and Inception reference statistics all read folders here, so each gets
the same files, order and labels. The listing rule (image files: torchvision's IMG_EXTENSIONS, any case):

- **Class tree** (subfolders hold the images): exactly torchvision's ImageFolder (DiT's order, ImageNet's
  labels): classes are the subfolder names sorted as strings, label = position in that list; files are
  found recursively inside each class folder.
- **Flat folder** (images directly in it): its image files sorted by name, no labels; subfolders
  without images are ignored.
- Images both directly and in subfolders are refused: which rule was meant is unclear.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ..errors import MissingFileError, UserError


@dataclass
class ImageList:
    """A listed folder: `files` relative to `root` in listing order, one label per file for a class
    tree (`labels` None and `class_names` empty for a flat folder)."""
    root: Path
    files: list[str]
    labels: list[int] | None
    class_names: list[str]

    def paths(self) -> list[Path]:
        return [self.root / f for f in self.files]


def list_image_folder(root: str | os.PathLike, require_classes: bool = False) -> ImageList:
    """Lists `root` by the rule in this module's docstring; `require_classes` refuses a flat folder
    (training and extraction need labels)."""
    root = Path(root)
    if not root.is_dir():
        raise MissingFileError(f"{root} is not a folder; pass a folder of images (one subfolder per class for labels)")
    from torchvision.datasets import folder  # imported here: seconds that commands reading no folder do not pay

    extensions = folder.IMG_EXTENSIONS
    try:
        class_names, class_to_idx = folder.find_classes(root)
    except FileNotFoundError:
        class_names, class_to_idx = [], {}
    samples = _class_samples(root, class_to_idx)
    top = sorted(entry.name for entry in os.scandir(root)
                 if entry.is_file() and folder.has_file_allowed_extension(entry.name, extensions))
    if samples and top:
        raise UserError(f"{root} holds images both directly ({top[0]}, ...) and in subfolders; put every image in a "
                        "class subfolder (labelled) or all of them directly in the folder (unlabelled)")
    if require_classes and not samples:
        if top or not class_names:
            raise UserError(f"{root} has no class subfolders of images; pass a folder holding one subfolder "
                            "of images per class")
        raise MissingFileError(f"no images ({', '.join(extensions)}) in the class folders of {root}")
    if samples:
        empty = sorted(set(class_names) - {class_names[label] for _, label in samples}) if require_classes else []
        if empty:  # a class that no image teaches (torchvision's ImageFolder refuses it too)
            raise UserError(f"class folder {root / empty[0]} holds no images ({', '.join(extensions)})"
                            f"{f' (and {len(empty) - 1} more)' if len(empty) > 1 else ''}; add its images or "
                            "remove the folder, so that every class has images")
        files = [os.path.relpath(path, root) for path, _ in samples]
        return ImageList(root, files, [label for _, label in samples], class_names)
    if not top:
        raise MissingFileError(f"no image files ({', '.join(extensions)}) in {root} or its subfolders")
    return ImageList(root, top, None, [])


def _class_samples(root: Path, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """torchvision's make_dataset (same files, order and labels), except that symbolic links are
    followed to each real folder and file once: a link back up the tree (a loop) or into another
    class folder is not walked again, so no image is listed twice or under another class's label."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    class_dirs = {os.path.realpath(root / name) for name in class_to_idx}
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    samples = []
    for name in sorted(class_to_idx):
        walked = []
        for folder, dirs, files in os.walk(root / name, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen_dirs:  # reached again through a link: already listed
                dirs[:] = []
                continue
            seen_dirs.add(real)
            dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(folder, d)) not in class_dirs]
            walked.append((folder, files))
        for folder, files in sorted(walked):
            for fname in sorted(files):
                path = os.path.join(folder, fname)
                real = os.path.realpath(path)
                if has_file_allowed_extension(fname, IMG_EXTENSIONS) and real not in seen_files:
                    seen_files.add(real)
                    samples.append((path, class_to_idx[name]))
    return samples


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM's center crop (DiT's): halve with a box filter while the short side is at least twice the target,
    resize the short side to `image_size` (bicubic), crop the center. torchvision's Resize+CenterCrop does
    not box-downsample first, so its pixels differ from the references'."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top: top + image_size, left: left + image_size])


def open_rgb(path: str | os.PathLike) -> tuple[Image.Image, str]:
    """Decodes an image now (a truncated or corrupt file raises here) and converts any mode to RGB.
    Returns (RGB image, the file's own mode)."""
    with warnings.catch_warnings():
        # PIL warns (not raises) on EXIF oddities or large images; real decoding errors still raise.
        warnings.simplefilter("ignore")
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            if mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit greys: scaled to 8 bits, not clipped at 255
                grey = np.clip(np.asarray(img, dtype=np.int64), 0, 65535) // 257
                return Image.fromarray(grey.astype(np.uint8)).convert("RGB"), f"{mode} (16-bit, scaled)"
            if mode == "P" and "transparency" in img.info:
                img = img.convert("RGBA")  # PIL asks for this route for transparent palettes
            return img.convert("RGB"), mode


def load_rgb(path: str | os.PathLike, image_size: int | None = None) -> np.ndarray:
    """An image file as uint8 (H, W, 3); with `image_size`, after ADM's center crop. An unreadable
    file is a UserError naming it (training and evaluation stop; extraction uses `load_and_crop`)."""
    try:
        img, _ = open_rgb(path)
    except (OSError, SyntaxError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        reason = " ".join(str(err).split())
        raise UserError(f"{path} is not a readable image ({reason}); remove or replace it") from None
    if image_size is not None:
        img = center_crop_arr(img, image_size)
    return np.asarray(img, dtype=np.uint8)


def load_and_crop(path: str | os.PathLike, image_size: int, min_side: int) -> tuple[np.ndarray | None, str, str]:
    """Like `load_rgb` with a crop, but a bad file is reported, never raised, so one broken JPEG
    cannot abort a long extraction. Returns (uint8 (S, S, 3) or None, action, detail) with action
    "ok", "converted" (detail: the conversion) or "skipped" (detail: why)."""
    try:
        img, mode = open_rgb(path)
        if min(img.size) < min_side:
            return None, "skipped", f"too small ({img.size[0]}x{img.size[1]} < --min-side {min_side})"
        array = np.asarray(center_crop_arr(img, image_size), dtype=np.uint8)
    except Exception as err:  # noqa: BLE001 - any decoder failure means "skip this file"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        # PIL names an in-memory source by its repr, whose address changes from run to run.
        reason = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "(in-memory bytes)", reason)
        return None, "skipped", f"unreadable ({type(err).__name__}: {reason})"
    if mode != "RGB":
        return array, "converted", f"{mode} -> RGB"
    return array, "ok", ""


@dataclass
class LoadedImage:
    position: int
    array: np.ndarray | None  # uint8 (S, S, 3) after the ADM crop, None when skipped
    action: str  # "ok", "converted" or "skipped"
    detail: str = ""


class CroppedImages(Dataset):
    """Positions of a listing -> LoadedImage (tolerant `load_and_crop`), decoded in DataLoader workers."""

    def __init__(self, images: ImageList, image_size: int, min_side: int):
        self.images, self.image_size, self.min_side = images, image_size, min_side

    def __len__(self) -> int:
        return len(self.images.files)

    def __getitem__(self, position: int) -> LoadedImage:
        path = self.images.root / self.images.files[position]
        return LoadedImage(position, *load_and_crop(path, self.image_size, self.min_side))
