"""The one request type every front builds, by keyword, in :func:`to_request`.

A front (the page, ``/generate`` through gradio_client, AUTOMATIC1111, OpenAI, MCP, the jobs API) parses its own
body, prepares any image (image_prep.py), then calls :func:`to_request` with the names ``/generate`` uses. The
service (service.py) runs what it returns. No Gradio, no HTTP here.
"""

from __future__ import annotations

import dataclasses

from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.service.image_prep import PasteBack
from sdxl_engine.service.styles import NO_STYLE, apply_style, get_style

MAX_CALLS = 4  # engine calls one request may ask for (images: up to 4 x the engine's batch)


@dataclasses.dataclass(frozen=True)
class Request:
    """One client's ask, whichever front sent it.

    Attributes:
        engine: the engine's request for the first engine call (the style applied; not validated yet).
        prompt, negative_prompt: as the client typed them (before the style): they name the PNG files.
        style: the style preset's name as the page shows it (styles.NO_STYLE for none).
        images: how many images the client wants, 1 to MAX_CALLS x the engine's batch; 0 = one call's batch.
            More than a batch runs further engine calls, one after another, the seeds following on.
        paste_back: None, or what turns the engine's images into the answer's (image_prep.PasteBack: the
            original's pixels outside an inpainting mask, "only masked"'s uncrop), applied after each call.
        parameters: more A1111 infotext entries for the PNGs (``Mask blur``, ``Inpaint area``...).
        fields: the front's names of the request's fields where they differ from these (``{"num_inference_steps":
            "steps"}``), so a refusal names the field the client sent (:meth:`field`).
    """

    engine: GenerateRequest
    prompt: str
    negative_prompt: str = ""
    style: str = NO_STYLE
    images: int = 0
    paste_back: PasteBack | None = dataclasses.field(default=None, compare=False)
    parameters: dict = dataclasses.field(default_factory=dict)
    fields: tuple[tuple[str, str], ...] = ()

    def field(self, name: str) -> str:
        """The front's name of the request field ``name`` (``width/height`` maps each side)."""
        names = dict(self.fields)
        return "/".join(dict.fromkeys(names.get(part, part) for part in str(name).split("/")))


def to_request(*, prompt, negative_prompt=None, seed=-1, guidance_scale=None, num_inference_steps=None, width=None,
               height=None, sampler=None, style=NO_STYLE, images: int = 0, client: str = "",
               paste_back: PasteBack | None = None, parameters: dict | None = None, field_names: dict | None = None,
               **fields) -> Request:
    """The :class:`Request` for a front's values, by the names ``/generate`` uses (None = the engine's default;
    width/height 0 = the model's default; seed -1 = random), plus any further GenerateRequest field (``image``,
    ``mask``, ``strength``, ``start_step``, ``outpaint``, ``refiner_switch_at``, ``hires_*``...). ``style`` is
    applied here (the hires pass's prompts take it too, as A1111's ``all_hr_prompts``), so the engine sees plain
    text. Values are not validated here: the service validates them with the engine's rules (validation.validate).

    Raises:
        InvalidRequest: ``style`` names no preset (styles.UnknownStyle).
        TypeError: a keyword that is no GenerateRequest field (a front's bug, not a client's).
    """
    negative_prompt = "" if negative_prompt is None else negative_prompt
    styled, styled_negative = apply_style(style, prompt, negative_prompt)
    if fields.get("hires_prompt") is not None or fields.get("hires_negative_prompt") is not None:
        fields["hires_prompt"], fields["hires_negative_prompt"] = apply_style(
            style, fields.get("hires_prompt") or prompt, fields.get("hires_negative_prompt") or negative_prompt)
    engine = GenerateRequest(prompt=styled, negative_prompt=styled_negative, seed=seed, guidance_scale=guidance_scale,
                             num_inference_steps=num_inference_steps, width=width, height=height,
                             sampler=sampler, client=client, **fields)
    return Request(engine, prompt if isinstance(prompt, str) else str(prompt), negative_prompt, get_style(style).name,
                   images, paste_back, dict(parameters or {}), tuple((field_names or {}).items()))
