"""The image tool as a Gradio endpoint: ``/image_to_image`` (an API endpoint of the page without widgets, ``gr.api``,
for gradio_client; MCP's tool of the same name is mcp_server.py's). Its inputs, description and picture preparation
are tools.py's, shared with the MCP tool: the image and the optional mask come as base64 text in the call, decoded
in memory (uploads.decode_image); no URL is ever fetched and nothing the client sends becomes a file. It is a Gradio
event of the page, so it submits to the service as the page's events do (handler.follow: the caller's job, the
per-client cap of every front): img2img of the whole image, or with a mask inpainting under the overlay that keeps
the original's pixels outside it; with the loaded refiner, or a hires fix (``upscale``) of the picture.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import gradio as gr

from sdxl_engine.engine.validation import InvalidRequest
from sdxl_engine.program.schedulers import DEFAULT_SCHEDULE_TYPE
from sdxl_engine.service.request import to_request
from sdxl_engine.service.styles import NO_STYLE
from sdxl_engine.serving import admission
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.tools import (
    IMAGE_TO_IMAGE,
    TOOL_FIELDS,
    control_fields,
    image_doc,
    ip_fields,
    model_field,
    tool_inputs,
)
from sdxl_engine.serving.handler import follow, left_out, refuse

LOG = logging.getLogger(__name__)

API_NAME = IMAGE_TO_IMAGE
TOOL_DOC = image_doc()  # the MCP tool's description too (tools.py): Gradio's API page reads its Args


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
                             control_image: str = "", control_model: str = "", control_weight: float = 1.0,
                             control_start: float = 0.0, control_end: float = 1.0, control_module: str = "none",
                             model: str = "", schedule_type: str = DEFAULT_SCHEDULE_TYPE,
                             ip_adapter_image: str = "", ip_adapter_model: str = "", ip_adapter_weight: float = 1.0,
                             ip_adapter_start: float = 0.0, ip_adapter_end: float = 1.0, control_type: str = "",
                             ip_adapter_embeds: list | str = "", request: gr.Request = None) -> tuple[list, dict]:
        while engine is not None and not engine.ready.is_set():
            await asyncio.sleep(0.5)
        limits = getattr(engine, "limits", None)
        default = limits.default_size if limits is not None else (1024, 1024)
        try:
            fields, paste_back, w, h = await asyncio.to_thread(
                tool_inputs, image, mask, strength, width, height, default, refiner_switch_at, upscale,
                limits if model in ("", getattr(limits, "model", "")) else None)  # the default model's limits
            control = await asyncio.to_thread(control_fields, control_image, control_model, control_weight,
                                              control_start, control_end, control_module, control_type)
            ip = await asyncio.to_thread(ip_fields, ip_adapter_image, ip_adapter_model, ip_adapter_weight,
                                         ip_adapter_start, ip_adapter_end, ip_adapter_embeds)
        except ApiError as err:
            LOG.info(f"[app] request refused: {API_NAME}: {err.message}")
            raise gr.Error(err.message, print_exception=False) from None
        names = {**{field: name for field, name in TOOL_FIELDS.items() if field in fields},
                 **control.pop("field_names", {}), **ip.pop("field_names", {})}
        fields.update(control)
        fields.update(ip)
        try:
            settings = left_out(dict(guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                                     sampler=sampler), config, model, request)  # gradio_client's left out
            asked = to_request(prompt=prompt, negative_prompt=negative_prompt, seed=seed, **settings, width=w,
                               height=h, schedule_type=schedule_type, style=NO_STYLE,
                               client=admission.client_address(request), paste_back=paste_back,
                               field_names=names, **fields, **model_field(model))
        except InvalidRequest as err:
            raise refuse(err) from err
        outputs = [out async for out in follow(requests, asked, request, front="page")]  # previews, then the images
        gallery, info = outputs[-1]
        # As a Gallery's value (FileData items): Gradio serves each file and gradio_client downloads it, as it does
        # /generate's; bare paths would name files on the server that no remote client can read.
        return [{"image": gr.FileData(path=path).model_dump(), "caption": caption} for path, caption in gallery], info

    image_to_image.__doc__ = TOOL_DOC
    return image_to_image
