"""Image preprocessing shared by latent extraction, image-folder training and reference statistics."""
from __future__ import annotations

import numpy as np
from PIL import Image


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM's center crop (used by DiT): halve with a box filter while the short side is at least
    twice the target, resize the short side to `image_size` with bicubic, then crop the center.

    Written by hand because torchvision's Resize+CenterCrop does not box-downsample first and
    so gives different pixels than the reference statistics expect.
    """
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top: top + image_size, left: left + image_size])
