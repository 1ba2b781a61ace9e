"""The image tool as a Gradio endpoint: ``/image_to_image`` (an API endpoint of the page without widgets, ``gr.api``,
for gradio_client; MCP's tool of the same name is mcp_server.py's). Its inputs, description and picture preparation
are tools.py's, shared with the MCP tool: the image and the optional mask come as base64 text in the call, decoded
in memory (uploads.decode_image); no URL is ever fetched and nothing the client sends becomes a file. The engine runs
it as any request (handler.handle_generate with handler.ProtocolInputs): img2img of the whole image, or with a mask
inpainting under the overlay that keeps the original's pixels outside it; with the loaded refiner, or a hires fix
(``upscale``) of the picture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gradio as gr

from sdxl_engine.service.styles import NO_STYLE
from sdxl_engine.serving import admission
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.tools import IMAGE_DOC, IMAGE_TO_IMAGE, TOOL_FIELDS, tool_inputs
from sdxl_engine.serving.handler import ProtocolInputs

LOG = logging.getLogger(__name__)

API_NAME = IMAGE_TO_IMAGE
TOOL_DOC = IMAGE_DOC  # the MCP tool's description too (tools.py): Gradio's API page reads its Args


def tool_message(message: str) -> str:
    """An engine refusal's ``message`` with the engine's field name it starts with (:data:`TOOL_FIELDS`) as this
    tool's input name (``hires_scale: ...`` -> ``upscale: ...``); any other message as it is."""
    field, colon, rest = message.partition(":")
    return f"{TOOL_FIELDS[field]}:{rest}" if colon and field in TOOL_FIELDS else message


def image_tool(handle: Callable, config, engine=None) -> Callable:
    """The ``image_to_image`` endpoint's function: its parameters are the MCP tool's inputs (TOOL_DOC describes
    them), its defaults the page's (``config``); it calls ``handle`` (handler.handle_generate minus the engine)
    with the decoded image (:func:`tool_inputs`) once ``engine`` (its default size) has started, and returns
    (gallery items, info) as ``generate`` does. A refused input is one log line and a gr.Error with its message."""

    def image_to_image(prompt: str, image: str, mask: str = "", strength: float = -1.0, negative_prompt: str = "",
                       seed: int = -1, guidance_scale: float = config.guidance_scale,
                       num_inference_steps: int = config.num_inference_steps, width: int = 0, height: int = 0,
                       sampler: str = config.sampler, refiner_switch_at: float = 1.0, upscale: float = 1.0,
                       request: gr.Request = None) -> tuple[list, dict]:
        if engine is not None:
            engine.ready.wait()
        limits = getattr(engine, "limits", None)
        default = limits.default_size if limits is not None else (1024, 1024)
        try:
            fields, finish, w, h = tool_inputs(image, mask, strength, width, height, default, refiner_switch_at,
                                               upscale)
        except ApiError as err:
            LOG.info(f"[app] request refused: {API_NAME}: {err.message}")
            raise gr.Error(err.message, print_exception=False) from None
        try:
            gallery, info, _ = handle(prompt, negative_prompt, seed, guidance_scale, num_inference_steps, w, h,
                                      NO_STYLE, sampler, client=admission.client_address(request),
                                      extra=ProtocolInputs(fields, finish))
        except gr.Error as err:  # the engine's refusals name its fields: this tool's names instead
            raise gr.Error(tool_message(str(err.message)), print_exception=False) from None
        # As a Gallery's value (FileData items): Gradio serves each file and gradio_client downloads it, as it does
        # /generate's; bare paths would name files on the server that no remote client can read.
        return [{"image": gr.FileData(path=path).model_dump(), "caption": caption} for path, caption in gallery], info

    image_to_image.__doc__ = TOOL_DOC
    return image_to_image
