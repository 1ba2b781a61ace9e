"""The page's image to image input: the image editor's value (files Gradio's upload route wrote, or a gallery
PNG sent to the editor) turned into the engine's request fields (engine.validation.GenerateRequest ``image``,
``mask``, ``strength``, ``outpaint``, ``refiner_switch_at``) and the answer's finish (the original pasted back
outside the mask). Plain numpy and Pillow: no Gradio, no engine.

The editor's value (Gradio's ImageEditor/ImageMask ``EditorData``, sent as it is: the event does not
preprocess) is ``{"background": file, "layers": [file, ...], "composite": file}``, each file a dict with a
``path``. The background is the picture; the layers hold the brush strokes (RGBA, opaque where drawn), whose
union is the mask: every pixel a stroke touched (alpha > 0) is repainted. Files are read with a size bound and
decoded by apis.uploads.open_image (formats, side, EXIF, decompression bombs); a refusal is apis.errors.ApiError
400 naming the field, which the handler shows as gr.Error.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
from PIL import Image

from sdxl_engine.service.image_prep import PasteBack
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.uploads import MAX_IMAGE_BYTES, open_image

LANCZOS = Image.Resampling.LANCZOS
IMG2IMG, INPAINT, OUTPAINT = "Image to image", "Inpaint (repaint the drawn area)", "Outpaint (add pixels at the sides)"
MODES = (IMG2IMG, INPAINT, OUTPAINT)
# Strength per mode, set on the slider when the mode changes. Image to image: A1111's and the engine's 0.75
# (validation.DEFAULT_STRENGTH). Inpaint and outpaint: 1, the engine's pure-noise start in the masked area
# (diffusers' StableDiffusionXLInpaintPipeline defaults to 0.9999 for the same reason: is_strength_max).
DEFAULT_STRENGTH = {IMG2IMG: 0.75, INPAINT: 1.0, OUTPAINT: 1.0}
SIDES = ("Left", "Top", "Right", "Bottom")  # outpaint's order, as GenerateRequest.outpaint
MIN_INNER_SIDE = 8  # pixels the picture keeps inside an outpainted canvas


@dataclasses.dataclass(frozen=True)
class EditorImage:
    """The editor's picture and drawn mask as read: ``image`` (H, W, 3) uint8 RGB; ``mask`` (H, W) uint8 of 0
    and 255 (255 = drawn, repaint) at the image's size, or None when nothing was drawn."""

    image: np.ndarray
    mask: np.ndarray | None


def editor_paths(value) -> list[str]:
    """Every file path in an editor value (background, layers, composite); [] for anything else."""
    if not isinstance(value, dict):
        return []
    files = [value.get("background"), value.get("composite")]
    files += value.get("layers") if isinstance(value.get("layers"), list) else []
    return [f["path"] for f in files if isinstance(f, dict) and isinstance(f.get("path"), str)]


def read_file(path: str, field: str) -> bytes:
    """The bytes of ``path`` (an upload or the app's own PNG), at most MAX_IMAGE_BYTES (checked before reading).

    Raises ApiError 400 naming ``field`` when the file is gone (a finished request deleted its upload: upload
    again) or too large."""
    try:
        size = os.stat(path).st_size
        if size > MAX_IMAGE_BYTES:
            raise ApiError(400, f"{field}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", field)
        with open(path, "rb") as handle:
            return handle.read(MAX_IMAGE_BYTES + 1)
    except OSError:
        raise ApiError(400, f"{field}: the image is no longer on the server (each upload is deleted after its "
                            "request): load the image into the editor again", field) from None


def read_editor(value, allowed: Callable[[str], bool]) -> EditorImage:
    """The picture and mask of an editor value (module docstring). ``allowed(path)``: whether the page may read
    that file (an upload, or one of the app's own PNGs); the guard checked it too.

    Raises ApiError 400 naming ``image`` (no picture, a file the page may not read, not an image) or ``mask``
    (a layer that is not an image)."""
    background = value.get("background") if isinstance(value, dict) else None
    path = background.get("path") if isinstance(background, dict) else None
    if not isinstance(path, str):
        raise ApiError(400, "image: no image in the editor: upload one (or send one from the gallery) first",
                       "image")
    for name in editor_paths(value):
        if not allowed(name):
            raise ApiError(400, "image: not a file this page uploaded", "image")
    image = np.asarray(open_image(read_file(path, "image"), "image", "RGB"))
    drawn = None
    for layer in value.get("layers") or []:
        if not isinstance(layer, dict) or not isinstance(layer.get("path"), str):
            continue
        alpha = np.asarray(open_image(read_file(layer["path"], "mask"), "mask", "RGBA"))[..., 3]
        if alpha.shape != image.shape[:2]:  # a layer is the canvas' size; resized as a mask is, nearest
            alpha = np.asarray(Image.fromarray(alpha).resize(image.shape[1::-1], Image.Resampling.NEAREST))
        drawn = alpha > 0 if drawn is None else drawn | (alpha > 0)
    mask = None if drawn is None or not drawn.any() else np.where(drawn, 255, 0).astype(np.uint8)
    return EditorImage(image, mask)


def resized(pixels: np.ndarray, width: int, height: int, resample=LANCZOS) -> np.ndarray:
    """``pixels`` ((H, W, 3) or (H, W) uint8) resized to width x height (Pillow, LANCZOS by default); as it is when
    already that size."""
    if pixels.shape[1] == width and pixels.shape[0] == height:
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample))


def paste_back(original: np.ndarray, keep: np.ndarray) -> PasteBack:
    """The answer's finish: each image ((n, H, W, 3) uint8) with ``original`` ((H, W, 3) uint8) where ``keep``
    ((H, W) bool) is set, so the pixels outside the mask are the picture's exactly, not their VAE round trip
    (A1111's overlay with a binary mask: image_prep.PasteBack)."""
    return PasteBack(original, (~np.asarray(keep, bool)).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class Request:
    """What the page's image to image event asks of the engine: ``fields`` (GenerateRequest keywords) and
    ``finish`` (None, or the paste-back of :func:`paste_back`), handed to service.request.to_request as its
    further fields and ``paste_back``."""

    fields: dict
    finish: PasteBack | None


def request_fields(picture: EditorImage, mode: str, strength, width: int, height: int, sides=(), pixels=0,
                   refiner_switch_at=None) -> Request:
    """The engine fields for ``picture`` in ``mode`` (one of MODES) at the page's resolution width x height.

    1. The picture (and its mask, nearest) is resized to width x height (Pillow LANCZOS; not cropped, so another
       aspect ratio is stretched): the engine makes only its own sizes. Outpaint resizes it to the size left
       once ``pixels`` are taken off each side in ``sides`` (names of SIDES), so the grown canvas is the
       resolution.
    2. Image to image: image and strength. Inpaint: image, mask (required) and strength; the answer keeps the
       picture's pixels outside the mask (:func:`paste_back`). Outpaint: image, its mask if drawn, ``outpaint``
       and strength; the answer keeps the picture's unmasked pixels inside the canvas.
    ``refiner_switch_at`` goes on as it is (None: not sent); the engine validates it and ``strength``.

    Raises ApiError 400 naming ``mode``, ``mask``, ``outpaint`` or ``width`` for what the page cannot send."""
    if mode not in MODES:
        raise ApiError(400, f"mode: one of {', '.join(MODES)}", "mode")
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        raise ApiError(400, "width: pick a resolution (the list fills once the engine is ready)", "width")
    fields: dict = {"strength": strength}
    if refiner_switch_at is not None:
        fields["refiner_switch_at"] = refiner_switch_at
    if mode == OUTPAINT:
        chosen = [side for side in SIDES if side in (sides or ())]
        if not chosen or not isinstance(pixels, int) or pixels <= 0:
            raise ApiError(400, "outpaint: pick at least one side and a number of pixels above 0", "outpaint")
        add = tuple(pixels if side in chosen else 0 for side in SIDES)  # (left, top, right, bottom)
        inner = (width - add[0] - add[2], height - add[1] - add[3])
        if min(inner) < MIN_INNER_SIDE:
            raise ApiError(400, f"outpaint: {pixels} pixels on {', '.join(chosen).lower()} leave the picture "
                                f"{inner[0]}x{inner[1]} of the {width}x{height} canvas: fewer pixels or a larger "
                                "resolution", "outpaint")
        image = resized(picture.image, *inner)
        fields.update(image=image, outpaint=add)
        keep = np.zeros((height, width), bool)
        inside = np.ones(inner[::-1], bool)
        if picture.mask is not None:
            mask = resized(picture.mask, *inner, Image.Resampling.NEAREST)
            fields["mask"] = mask
            inside = mask < 128
        keep[add[1]:add[1] + inner[1], add[0]:add[0] + inner[0]] = inside
        canvas = np.pad(image, ((add[1], add[3]), (add[0], add[2]), (0, 0)), mode="edge")
        return Request(fields, paste_back(canvas, keep))
    image = resized(picture.image, width, height)
    fields["image"] = image
    if mode == IMG2IMG:
        return Request(fields, None)
    if picture.mask is None:
        raise ApiError(400, "mask: draw over the part to repaint with the brush first", "mask")
    mask = resized(picture.mask, width, height, Image.Resampling.NEAREST)
    fields["mask"] = mask
    return Request(fields, paste_back(image, mask < 128))
