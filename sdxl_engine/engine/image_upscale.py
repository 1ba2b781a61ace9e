"""Hires fix's pixel upscalers: the first pass's images resized on the host, as AUTOMATIC1111 does for an
``hr_upscaler`` that is not one of its latent modes (processing.py ``sample_hr_pass``: the decoded images to uint8,
``images.resize_image(0, image, W, H, upscaler_name)``, then encoded again for the second pass).

A1111's built-in upscalers (modules/upscaler.py): ``None`` (``UpscalerNone``: no upscale of its own, so the
final Lanczos resize does it all), ``Lanczos`` and ``Nearest`` (Pillow's filters). :func:`upscale_images` follows
``resize_image`` mode 0 with ``Upscaler.upscale``: the upscaler's own resize to ``int(side * scale)``, Lanczos to
its multiple of 8 when that differs, and Lanczos to the target when that differs again.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# A1111's name -> the Pillow filter of its own resize (None: the upscaler leaves the image as it is).
IMAGE_UPSCALERS = {"None": None, "Lanczos": Image.Resampling.LANCZOS, "Nearest": Image.Resampling.NEAREST}


def upscale_image(image: Image.Image, width: int, height: int, upscaler: str) -> Image.Image:
    """One image resized to ``width`` x ``height`` pixels by the A1111 upscaler ``upscaler`` (a key of
    :data:`IMAGE_UPSCALERS`), as A1111's ``images.resize_image(0, image, width, height, upscaler)``.

    Raises KeyError for another name (the engine validated it)."""
    resample = IMAGE_UPSCALERS[upscaler]
    scale = max(width / image.width, height / image.height)
    if scale > 1.0:
        # Upscaler.upscale: its destination is int(side * scale) rounded down to a multiple of 8
        dest = (int(image.width * scale // 8 * 8), int(image.height * scale // 8 * 8))
        if resample is not None:  # do_upscale: the filter to int(side * scale)
            image = image.resize((int(image.width * scale), int(image.height * scale)), resample=resample)
        if image.size != dest:
            image = image.resize(dest, resample=Image.Resampling.LANCZOS)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    return image


def upscale_images(images: np.ndarray, width: int, height: int, upscaler: str) -> np.ndarray:
    """(b, h, w, 3) uint8 -> (b, height, width, 3) uint8: each image by :func:`upscale_image`."""
    return np.stack([np.asarray(upscale_image(Image.fromarray(np.asarray(image)), width, height, upscaler))
                     for image in images])
