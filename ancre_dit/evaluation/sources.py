"""Where images and statistics come from: an ADM npz (read lazily) or a folder of image files
(listed and read by ancre_dit.data.image_folder).

50K samples at 256x256 are 9.8 GB of uint8: `open_adm_npz` memory-maps `arr_0` when the npz
stores it uncompressed (np.savez, what sample.py and ADM write), so features are computed batch
by batch without holding every image in memory. Anything else falls back to `load_adm_npz`.
"""
from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from ..data.adm_npz import STAT_KEYS, ADMBatch, check_labels, check_stats, load_adm_npz
from ..data.image_folder import load_rgb
from ..errors import UserError


def _memmap_member(path: Path, member: str) -> np.ndarray | None:
    """A read-only memmap of `member` (.npy) inside an uncompressed zip, or None if not possible
    (numpy's mmap_mode is ignored for .npz files)."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            return None
        if info.compress_type != zipfile.ZIP_STORED:
            return None
        # The local header (30 bytes + name + extra; its extra may differ from the central one).
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            return None
        if fortran or dtype.hasobject:
            return None
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def open_adm_npz(path: str | os.PathLike) -> ADMBatch:
    """Like load_adm_npz, but `images` is a memmap (uint8, (N, H, W[, 1|3])) when possible;
    consumers convert each batch with to_rgb_uint8."""
    path = Path(path)
    try:
        images = _memmap_member(path, "arr_0.npy")
    except (OSError, zipfile.BadZipFile, ValueError):
        images = None
    if images is None or images.dtype != np.uint8 or images.ndim not in (3, 4):
        return load_adm_npz(path)  # compressed, odd, or broken: its reader gives the clear errors
    if images.ndim == 4 and images.shape[-1] not in (1, 3):
        raise UserError(f"{path}: arr_0 holds images of shape {tuple(images.shape)}; ADM images are (N, H, W[, 1|3]) "
                        f"uint8: {_layout_fix(images.shape)}, and save again")
    with np.load(path) as data:
        labels = check_labels(data["arr_1"], len(images), path) if "arr_1" in data.files else None
        stats = {k: data[k] for k in STAT_KEYS if k in data.files}
    check_stats(stats, path)
    return ADMBatch(images, labels, stats)


def _layout_fix(shape: tuple[int, ...]) -> str:
    """What turns an (N, ?, ?, ?) array into ADM's (N, H, W, C) one."""
    if shape[1] in (1, 3, 4):
        return "it looks channels-first (N, C, H, W): transpose it, images.transpose(0, 2, 3, 1)"
    if shape[-1] == 4:
        return "drop the alpha channel, images[..., :3]"
    return f"{shape[-1]} is not a channel count of RGB or grayscale images"


class ImageFolderBatches:
    """Batches of center-cropped uint8 images read from files, decoded by DataLoader workers."""

    def __init__(self, files: list[Path], image_size: int | None, batch_size: int, workers: int = 0):
        self.files, self.image_size, self.batch_size, self.workers = files, image_size, batch_size, workers

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> np.ndarray:
        image = load_rgb(self.files[i], self.image_size)
        if self.image_size is None and i > 0 and image.shape != self.first_shape:
            raise UserError(f"{self.files[i]} is {image.shape[:2]}, not {self.first_shape[:2]} like the first "
                             f"image; pass an image size so every image is center-cropped to one size")
        return image

    def __iter__(self) -> Iterator[np.ndarray]:
        from torch.utils.data import DataLoader

        self.first_shape = load_rgb(self.files[0], self.image_size).shape  # read once, before workers start
        yield from DataLoader(self, batch_size=self.batch_size, num_workers=self.workers, collate_fn=np.stack)
