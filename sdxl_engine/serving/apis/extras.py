"""AUTOMATIC1111's "Extras" upscaling (``POST /sdapi/v1/extra-single-image``, ``extra-batch-images``) with the
upscalers this server has: Pillow's Lanczos and Nearest (A1111's own ``Lanczos`` and ``Nearest``; its ESRGAN
and other model upscalers are not here).

Client images are bounded before any pixel is decoded (uploads.decode_image). An answer's
image is at most :data:`MAX_OUTPUT_SIDE` pixels a side, a batch at most :data:`MAX_BATCH` images and all its
results together at most :data:`MAX_TOTAL_OUTPUT` pixels. A
refusal is :class:`core.ApiError` 400 naming the field (``image``, ``imageList[i].data``,
``upscaling_resize``...), which the route answers in A1111's 422 shape.

Sizes follow A1111 (modules/upscaler.py ``Upscaler.upscale``, scripts/postprocessing_upscale.py): by a
factor, each side ``int(side * factor)`` rounded down to a multiple of 8 (at least 1 pixel here, where
A1111 would fail on a side under 8); to a size (``resize_mode`` 1), the factor that covers both sides
(``max(w / width, h / height)``), then with ``upscaling_crop`` the result centred on a black canvas of
exactly that size.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Literal

from PIL import Image, PngImagePlugin
from pydantic import BaseModel, ConfigDict, Field

from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.uploads import decode_image

MAX_OUTPUT_SIDE = 4096  # pixels, each side of an answer's image
MAX_BATCH = 16  # images in one extra-batch-images request
MAX_TOTAL_OUTPUT = 2 * 4096 * 4096  # pixels of all the answer's images together (its memory and size)
# A1111's names (modules/upscaler.py UpscalerNone, UpscalerLanczos, UpscalerNearest) and Pillow's filters.
UPSCALERS = {"None": None, "Lanczos": Image.Resampling.LANCZOS, "Nearest": Image.Resampling.NEAREST}


class ExtrasRequest(BaseModel):
    """A1111's ExtrasBaseRequest (modules/api/models.py): its fields, defaults and bounds. Honoured:
    ``resize_mode``, ``upscaling_resize``, ``upscaling_resize_w``/``_h``, ``upscaling_crop``,
    ``upscaler_1``; read and named in a warning when they would change the image (:func:`ignored`):
    ``upscaler_2`` with ``extras_upscaler_2_visibility`` > 0, ``gfpgan_visibility``, ``codeformer_visibility``.
    ``show_extras_results`` changes nothing: A1111 reads it for a folder of images only (not served here)."""

    model_config = ConfigDict(extra="allow")

    resize_mode: Literal[0, 1] = 0
    show_extras_results: bool = True
    gfpgan_visibility: float = Field(default=0, ge=0, le=1, allow_inf_nan=False)
    codeformer_visibility: float = Field(default=0, ge=0, le=1, allow_inf_nan=False)
    codeformer_weight: float = Field(default=0, ge=0, le=1, allow_inf_nan=False)
    upscaling_resize: float = Field(default=2, gt=0, allow_inf_nan=False)
    upscaling_resize_w: int = Field(default=512, ge=1)
    upscaling_resize_h: int = Field(default=512, ge=1)
    upscaling_crop: bool = True
    upscaler_1: str | None = "None"
    upscaler_2: str | None = "None"
    extras_upscaler_2_visibility: float = Field(default=0, ge=0, le=1, allow_inf_nan=False)
    upscale_first: bool = False


class ExtrasSingleImage(ExtrasRequest):
    """A1111's ExtrasSingleImageRequest: ``image``, base64 (or a data URL)."""

    image: str = ""


class FileData(BaseModel):
    """One image of A1111's ExtrasBatchImagesRequest: ``data`` base64 (or a data URL), ``name``."""

    data: str
    name: str = ""


class ExtrasBatchImages(ExtrasRequest):
    """A1111's ExtrasBatchImagesRequest: ``imageList``."""

    imageList: list[FileData]


def upscaler_list() -> list[dict]:
    """``GET /sdapi/v1/upscalers`` (A1111's UpscalerItem: name, model_name, model_path, model_url, scale), as
    A1111 lists its built-in ones: no model file, scale 4 (modules/upscaler.py UpscalerData's default)."""
    return [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
            for name in UPSCALERS]


def _side(side: int, factor: float) -> int:
    """A1111's target side for ``factor``: int(side * factor) down to a multiple of 8, at least 1 here."""
    exact = int(side * factor)
    return max(1, exact // 8 * 8 if exact >= 8 else exact)


def output_size(req: ExtrasRequest, width: int, height: int) -> tuple[int, int, float]:
    """(width, height, factor) of the answer for a ``width`` x ``height`` input (the module docstring's rules).
    Raises ApiError 400 naming the size fields when a side would exceed MAX_OUTPUT_SIDE."""
    if req.resize_mode == 1:
        factor = max(req.upscaling_resize_w / width, req.upscaling_resize_h / height)
        fields = "upscaling_resize_w/upscaling_resize_h"
    else:
        factor, fields = req.upscaling_resize, "upscaling_resize"
    size = (_side(width, factor), _side(height, factor))
    if req.resize_mode == 1 and req.upscaling_crop:
        size = (req.upscaling_resize_w, req.upscaling_resize_h)
    if max(size) > MAX_OUTPUT_SIDE:
        raise ApiError(400, f"{fields}: the result would be {size[0]}x{size[1]} pixels; at most "
                            f"{MAX_OUTPUT_SIDE}x{MAX_OUTPUT_SIDE} here", fields.split("/")[0])
    return size[0], size[1], factor


def check_upscaler(req: ExtrasRequest) -> None:
    """Raise ApiError 400 (``upscaler_1``) for a name this server does not have."""
    name = "None" if req.upscaler_1 in (None, "") else req.upscaler_1
    if name not in UPSCALERS:
        raise ApiError(400, f"upscaler_1: no upscaler {str(name)[:60]!r} here; one of {', '.join(UPSCALERS)}",
                       "upscaler_1")


def ignored(req: ExtrasRequest) -> list[str]:
    """Warnings naming the fields of ``req`` that would change the image and are not honoured here."""
    found = []
    if req.upscaler_2 not in (None, "", "None") and req.extras_upscaler_2_visibility > 0:
        found.append(f"upscaler_2 {str(req.upscaler_2)[:60]!r} (visibility {req.extras_upscaler_2_visibility:g}) "
                     "is not applied: one upscaler only here")
    for name in ("gfpgan_visibility", "codeformer_visibility"):
        if getattr(req, name) > 0:
            found.append(f"{name} {getattr(req, name):g} is not applied: no face restoration here")
    return found


def upscale(req: ExtrasRequest, image: Image.Image) -> tuple[Image.Image, dict]:
    """``image`` (RGB) upscaled as ``req`` asks, and A1111's postprocessing fields for its info text
    (``Postprocess upscale by`` / ``to``, ``Postprocess upscaler``, ``Postprocess crop to``). ``upscaler_1``
    "None" leaves the image as it is, as in A1111. Raises ApiError as :func:`output_size`."""
    name = "None" if req.upscaler_1 in (None, "") else req.upscaler_1
    resample = UPSCALERS[name]
    if resample is None:
        return image, {}
    width, height, factor = output_size(req, *image.size)
    info: dict = {}
    if req.resize_mode == 1:
        info["Postprocess upscale to"] = f"{req.upscaling_resize_w}x{req.upscaling_resize_h}"
    else:
        info["Postprocess upscale by"] = f"{req.upscaling_resize:g}"
    info["Postprocess upscaler"] = name
    if req.resize_mode == 1 and req.upscaling_crop:
        scaled = image.resize((_side(image.width, factor), _side(image.height, factor)), resample)
        canvas = Image.new("RGB", (width, height))
        canvas.paste(scaled, (width // 2 - scaled.width // 2, height // 2 - scaled.height // 2))
        info["Postprocess crop to"] = f"{width}x{height}"
        return canvas, info
    return image.resize((width, height), resample), info


def infotext(info: dict, warnings: list[str]) -> str:
    """The postprocessing text (``Key: value, ...``) with one line per warning."""
    return "\n".join([", ".join(f"{k}: {v}" for k, v in info.items()), *warnings]).strip()


def html_info(text: str) -> str:
    """A1111's ``html_info`` for a text (modules/ui_common.py plaintext_to_html: escaped lines in a <p>)."""
    return "<p>" + "<br>\n".join(html.escape(line) for line in text.split("\n")) + "</p>"


def encode(image: Image.Image, text: str) -> str:
    """``image`` as a base64 PNG carrying ``text`` in its ``postprocessing`` chunk (as A1111 writes it)."""
    meta = PngImagePlugin.PngInfo()
    if text:
        meta.add_text("postprocessing", text)
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=meta)
    return base64.b64encode(out.getvalue()).decode()


def run(req: ExtrasRequest, images: list[tuple[str, str]]) -> tuple[list[str], str, list[str]]:
    """Upscale ``images`` ((base64 data, field name) pairs) as ``req`` asks: (base64 PNGs, html_info,
    warnings). Every image is decoded and its answer's size checked before any is upscaled.
    Raises ApiError 400 naming the field at fault."""
    check_upscaler(req)
    if len(images) > MAX_BATCH:
        raise ApiError(400, f"imageList: {len(images)} images; at most {MAX_BATCH} in one request", "imageList")
    decoded = [decode_image(data, field) for data, field in images]
    if req.upscaler_1 not in (None, "", "None"):
        sizes = [output_size(req, *image.size) for image in decoded]
        total = sum(w * h for w, h, _ in sizes)
        if total > MAX_TOTAL_OUTPUT:
            raise ApiError(400, f"imageList: the results would hold {total} pixels; at most {MAX_TOTAL_OUTPUT} "
                                f"(two 4096x4096 images) in one request", "imageList")
    warnings = ignored(req)
    outputs, text = [], ""
    for image in decoded:
        result, info = upscale(req, image)
        text = infotext(info, warnings)
        outputs.append(encode(result, text))
    if not decoded:
        text = infotext({}, warnings)
    return outputs, html_info(text), warnings
