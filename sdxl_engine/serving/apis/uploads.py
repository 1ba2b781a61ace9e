"""Client images, bounded before any pixel is decoded: base64 (a ``data:image/...`` URL too) or raw bytes,
read in memory and never written to disk; PNG, JPEG or WebP only; at most :data:`MAX_IMAGE_BYTES` bytes and
:data:`MAX_INPUT_SIDE` pixels a side (the header's size is checked first, so a small file claiming a huge
image costs nothing; Pillow's decompression-bomb check stays on); truncated or broken data refused; EXIF
orientation applied, as a viewer shows the image. A refusal is :class:`core.ApiError` 400 naming the field,
which each protocol answers in its own error shape.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, ImageOps

from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.guard import MAX_IMAGE_BYTES  # one image file: also Gradio's per-file upload cap

MAX_INPUT_SIDE = 2048  # pixels, each side of a client's image: the largest SDXL size this server makes, and more
FORMATS = ("PNG", "JPEG", "WEBP")


def decode_base64(data: str, field: str) -> bytes:
    """A client's base64 text (``data:image/...;base64,`` prefix and line breaks allowed) as bytes.

    Raises ApiError 400 naming ``field``: not a string, a URL (never fetched), not base64, empty, over
    :data:`MAX_IMAGE_BYTES`."""
    text = data.strip() if isinstance(data, str) else ""
    if text.lower().startswith(("http://", "https://", "file:", "ftp://")):
        raise ApiError(400, f"{field}: a URL; this server never fetches one: send the image itself as base64 (or a "
                            "data:image/png;base64,... URL)", field)
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if len(text) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4096:  # before decoding: the text alone tells the size
        raise ApiError(400, f"{field}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", field)
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{field}: not base64 data", field) from None
    if not raw:
        raise ApiError(400, f"{field}: no image (empty)", field)
    return raw


def open_image(raw: bytes, field: str, mode: str = "RGB") -> Image.Image:
    """A client's image file (``raw``: PNG, JPEG or WebP bytes) decoded in memory, oriented by its EXIF tag
    (ImageOps.exif_transpose), converted to ``mode`` (``"RGB"``, ``"RGBA"``, ``"L"``; None keeps the file's).

    Raises ApiError 400 naming ``field``: over :data:`MAX_IMAGE_BYTES`, not an image, not PNG/JPEG/WebP, a side
    over :data:`MAX_INPUT_SIDE` (checked on the header, before the pixels are decoded), truncated or broken data.
    """
    if len(raw) > MAX_IMAGE_BYTES:
        raise ApiError(400, f"{field}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", field)
    if not raw:
        raise ApiError(400, f"{field}: no image (empty)", field)
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as image:  # reads the header only
            width, height = image.size
            if width > MAX_INPUT_SIDE or height > MAX_INPUT_SIDE:
                raise ApiError(400, f"{field}: the image is {width}x{height} pixels; at most "
                                    f"{MAX_INPUT_SIDE}x{MAX_INPUT_SIDE} here", field)
            image.load()
            oriented = ImageOps.exif_transpose(image)
            if mode is None:
                return oriented.copy() if oriented is image else oriented
            if mode == "RGBA" or oriented.mode in ("RGBA", "LA", "PA") or "transparency" in oriented.info:
                oriented = oriented.convert("RGBA")  # a palette's transparency becomes alpha first
            return oriented.convert(mode)
    except ApiError:
        raise
    except Image.DecompressionBombError:  # Pillow's own check on opening, far above the bound here
        raise ApiError(400, f"{field}: the image claims too many pixels; at most {MAX_INPUT_SIDE}x{MAX_INPUT_SIDE} "
                            "here", field) from None
    except (OSError, SyntaxError, ValueError, EOFError) as err:  # UnidentifiedImageError is an OSError
        reason = "not a PNG, JPEG or WebP image" if isinstance(err, Image.UnidentifiedImageError) \
            else f"a broken or truncated image ({str(err)[:80]})"
        raise ApiError(400, f"{field}: {reason}", field) from None


def decode_image(data: str, field: str, mode: str = "RGB") -> Image.Image:
    """A client's base64 image (:func:`decode_base64`) decoded (:func:`open_image`) as ``mode``.

    Raises ApiError 400 naming ``field`` (the two functions' refusals)."""
    return open_image(decode_base64(data, field), field, mode)
