"""The MCP image tool: ``image_to_image`` (an API endpoint of the page without widgets, ``gr.api``, which Gradio's
MCP server lists beside ``generate``). The image and the optional mask come as base64 text in the call, decoded in
memory (uploads.decode_image); no URL is ever fetched and nothing the client sends becomes a file. It is a Gradio
event of the page, so it submits to the service as the page's events do (handler.follow: the caller's job, the
per-client cap of every front): img2img of the whole image, or with a mask inpainting under the overlay that keeps
the original's pixels outside it; with the loaded refiner, or a hires fix (``upscale``) of the picture.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import gradio as gr
import numpy as np
from PIL import Image

from sdxl_engine.engine.validation import DEFAULT_STRENGTH, InvalidRequest
from sdxl_engine.service.image_prep import PasteBack, binary_mask, flatten, overlay, same_aspect
from sdxl_engine.service.request import to_request
from sdxl_engine.service.styles import NO_STYLE
from sdxl_engine.serving import admission
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.uploads import MAX_INPUT_SIDE, decode_image
from sdxl_engine.serving.handler import follow, refiner_switch, refuse

LOG = logging.getLogger(__name__)

API_NAME = "image_to_image"
MASK_STRENGTH = 1.0  # with a mask the white part is made anew (diffusers' inpainting default), as OpenAI's edits
LANCZOS = Image.Resampling.LANCZOS

# The image_to_image tool's description, as the generate tool's (handler.TOOL_DOC): Gradio reads its Args, one line
# per input. A backslash at a line's end continues that line (the text has no line break there).
TOOL_DOC = """Change a picture with SDXL: image to image (restyle the whole picture to the prompt) or, with a mask, \
inpainting (repaint only the mask's white part; every other pixel stays the original's). Makes the server's batch \
(4 images), seeds seed, seed+1, ...

Args:
    prompt: what the images should show, e.g. "a red circle on a blue background"
    image: the input picture as base64 PNG, JPEG or WebP (a data:image/...;base64, URL too), at most 2048 x 2048 \
pixels and 16 MiB; it is resized to width x height. URLs are not fetched: send the bytes
    mask: optional, base64 PNG of the picture's size (or its aspect ratio): white = repaint, black = keep (a mask \
with transparency: opaque = repaint). Empty: the whole picture changes
    strength: how much changes, above 0 to 1 (1 = made anew); -1 = 0.75 without a mask, 1.0 with one
    negative_prompt: what to keep out of the images (optional)
    seed: seed of the first image, 0 to max_seed; -1 picks one at random (the answer says which)
    guidance_scale: classifier-free guidance, 0 to 50; 1 or less turns it off
    num_inference_steps: denoising steps; with strength s about s x this many run
    width: output width in pixels, one of the model's sizes; 0 = the model's default
    height: output height in pixels, one of the model's sizes; 0 = the model's default
    sampler: an A1111 sampler name, as the generate tool takes
    refiner_switch_at: with a refiner loaded (the server's --refiner), the share of the steps on the base model \
before the refiner takes over, 0 to below 1 (0 = the refiner alone); 1 = no refiner
    upscale: 1 = off; above 1, at most 4 (e.g. 1.5 or 2) = hires fix: the picture (at width x height) upscaled by \
this factor (Lanczos) and denoised again at the larger size with strength (-1 = 0.7); no mask with it
Returns:
    the images (PNG, with their generation parameters) and a JSON record: seeds, size, strength, timings
"""


MAX_UPSCALE = 4.0  # A1111's "Upscale by" slider's top (hires fix); the engine also checks the size it makes
TOOL_FIELDS = {"hires_scale": "upscale", "hires_strength": "strength"}  # engine field -> this tool's input


def tool_inputs(image: str, mask: str, strength: float, width: int, height: int,
                default_size: tuple[int, int], refiner_switch_at=None,
                upscale=None) -> tuple[dict, PasteBack | None, int, int]:
    """(the engine's fields, the overlay or None, width, height) of one tool call: the image decoded (a transparent one
    flattened on white) and resized with Lanczos to ``width`` x ``height`` (0: ``default_size``'s side); the mask
    made binary (a1111_images.binary_mask), resized with the image, cut at 128 (255 = repaint), and the overlay
    of the original outside it; ``strength`` -1 (or None) takes 0.75 without a mask, 1.0 with one.
    ``refiner_switch_at`` (handler.refiner_switch: None or 1 = no refiner) goes on as sent. ``upscale`` other
    than None or 1 is the hires fix of the picture: ``hires_scale`` with ``hires_strength`` = ``strength`` (-1:
    the engine's default, validation.DEFAULT_HIRES_STRENGTH) and the engine's pixel upscaler for an input image
    (validation.DEFAULT_IMAGE_UPSCALER); the engine checks the scale and the size it makes.

    Raises ApiError 400 naming the field: a side that is not a whole number of 8 to 2048 pixels, an undecodable
    or oversized image or mask (uploads.decode_image), a mask of another aspect ratio, or with nothing to repaint;
    ``upscale`` with a mask, or outside 1 to :data:`MAX_UPSCALE`.
    """
    size = []
    for name, value, default in (("width", width, default_size[0]), ("height", height, default_size[1])):
        side = value or default
        if isinstance(side, float) and side.is_integer():
            side = int(side)
        if isinstance(side, bool) or not isinstance(side, int) or not 8 <= side <= MAX_INPUT_SIDE:
            raise ApiError(400, f"{name}: must be a whole number of pixels, 8 to {MAX_INPUT_SIDE}, or 0 for the "
                                f"model's default; got {value!r}", name)
        size.append(side)
    w, h = size
    picture = flatten(decode_image(image, "image", mode=None))
    original = picture.size
    if picture.size != (w, h):
        picture = picture.resize((w, h), LANCZOS)
    pixels = np.asarray(picture, dtype=np.uint8)
    fields: dict = {"image": pixels}
    finish = None
    if mask:
        grey = binary_mask(decode_image(mask, "mask", mode=None))
        if grey.size != original and not same_aspect(grey.size, original):
            raise ApiError(400, f"mask: is {grey.width}x{grey.height} pixels but the image is {original[0]}x"
                                f"{original[1]}: send a mask of the image's size (or its aspect ratio)", "mask")
        if grey.size != (w, h):
            grey = grey.resize((w, h), LANCZOS)
        repaint = np.where(np.asarray(grey) >= 128, 255, 0).astype(np.uint8)
        if not repaint.any():
            raise ApiError(400, "mask: has no white (repaint) pixel, so nothing would change: paint white where the "
                                "picture is to be repainted", "mask")
        fields["mask"] = repaint
        finish = overlay(pixels, (repaint == 255).astype(np.float32))
    switch = refiner_switch(refiner_switch_at)
    if switch is not None:
        fields["refiner_switch_at"] = switch
    if upscale is not None and upscale != 1:
        if isinstance(upscale, bool) or not isinstance(upscale, (int, float)) or not 1 < upscale <= MAX_UPSCALE:
            raise ApiError(400, f"upscale: 1 (off), or above 1 and at most {MAX_UPSCALE:g} (the hires fix's factor); "
                                f"got {upscale!r}", "upscale")
        if mask:
            raise ApiError(400, "upscale: upscales the whole picture: send no mask with it (or upscale 1)", "upscale")
        fields["hires_scale"] = upscale
        if strength is not None and strength != -1:
            fields["hires_strength"] = strength
        return fields, None, w, h
    if strength is None or strength == -1:
        strength = MASK_STRENGTH if mask else DEFAULT_STRENGTH
    fields["strength"] = strength
    return fields, finish, w, h


def image_tool(requests, config, engine=None) -> Callable:
    """The ``image_to_image`` endpoint's function: its parameters are the MCP tool's inputs (TOOL_DOC describes
    them), its defaults the page's (``config``); once ``engine`` (its default size) has started it decodes the
    image (:func:`tool_inputs`, on a worker thread), submits the request to ``requests`` (the service) as the
    caller's job and awaits it (handler.follow, as the page's events), and returns (gallery items, info) as
    ``generate`` does. A refused input is one log line and a gr.Error with its message, under this tool's input
    names (:data:`TOOL_FIELDS`)."""

    async def image_to_image(prompt: str, image: str, mask: str = "", strength: float = -1.0,
                             negative_prompt: str = "", seed: int = -1, guidance_scale: float = config.guidance_scale,
                             num_inference_steps: int = config.num_inference_steps, width: int = 0, height: int = 0,
                             sampler: str = config.sampler, refiner_switch_at: float = 1.0, upscale: float = 1.0,
                             request: gr.Request = None) -> tuple[list, dict]:
        while engine is not None and not engine.ready.is_set():
            await asyncio.sleep(0.5)
        limits = getattr(engine, "limits", None)
        default = limits.default_size if limits is not None else (1024, 1024)
        try:
            fields, paste_back, w, h = await asyncio.to_thread(tool_inputs, image, mask, strength, width, height,
                                                               default, refiner_switch_at, upscale)
        except ApiError as err:
            LOG.info(f"[app] request refused: {API_NAME}: {err.message}")
            raise gr.Error(err.message, print_exception=False) from None
        names = {field: name for field, name in TOOL_FIELDS.items() if field in fields}
        try:
            asked = to_request(prompt=prompt, negative_prompt=negative_prompt, seed=seed,
                               guidance_scale=guidance_scale, num_inference_steps=num_inference_steps, width=w,
                               height=h, sampler=sampler, style=NO_STYLE, client=admission.client_address(request),
                               paste_back=paste_back, field_names=names, **fields)
        except InvalidRequest as err:
            raise refuse(err) from err
        outputs = [out async for out in follow(requests, asked, request, front="mcp")]  # previews, then the images
        gallery, info = outputs[-1]
        # As a Gallery's value (FileData items): Gradio serves each file and gradio_client downloads it, as it does
        # /generate's; bare paths would name files on the server that no remote client can read.
        return [{"image": gr.FileData(path=path).model_dump(), "caption": caption} for path, caption in gallery], info

    image_to_image.__doc__ = TOOL_DOC
    return image_to_image
