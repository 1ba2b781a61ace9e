"""OpenAI's Images API on this server: ``POST /v1/images/generations``, ``POST /v1/images/edits``, ``GET /v1/models``.

``POST /v1/images/generations`` runs the page's ``/generate`` event (core.generate: same queue,
handler, checks and messages). Fields (:func:`to_call`): ``prompt``; ``n`` images (default 1; the
engine makes its batch per call, fewer return the first ones, more run further calls);
``size`` ``"WxH"`` (one of the model's sizes; ``"auto"`` or left out: its default); ``model``
(left out: the default; or one of the ids ``GET /v1/models`` lists); ``response_format`` ``b64_json``
(default here) or ``url`` (``/v1/images/files/<token>.png`` on this server, an unguessable name
for the PNG, valid while the temp folder keeps it); ``output_format`` ``png`` (default), ``jpeg`` or
``webp`` with ``output_compression`` (0-100, the encoder's quality; the parameters text goes in the
EXIF UserComment, as A1111 writes it); ``stream`` (Server-Sent Events: one
``image_generation.completed`` event per image, no partial images); ``user`` (accepted, not stored);
not OpenAI's (the SDK's ``extra_body``): :data:`EXTENSIONS`, the engine's refiner and hires fix fields.
OpenAI's model names (``gpt-image-*``, ``dall-e-2``, ``dall-e-3``) are served as aliases of the
default model, answering as that model does by default (:func:`model_family`). ``quality`` ``hd`` or
``high`` runs the base model with the loaded refiner (``--refiner``; :func:`with_quality`). Other fields
that would change the images (another ``quality``, ``style``, ``background``, ``partial_images``) are not
honoured: each is named in one log line and the ``X-SDXL-Warnings`` header (:func:`ignored`).
Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with its
statuses (400 bad value, 401 key, 404 model, 429 over the per-client limit, 500/503 server).

``POST /v1/images/edits`` (multipart/form-data, as OpenAI's ``images.edit`` and Open WebUI send it) edits
one image (:func:`read_form`, :func:`edit_form`, :func:`edit_call`): ``image`` (a file; or ``image[]``, several, of
which the first is edited and the others are named in a warning), ``prompt``, optional ``mask`` (a PNG the
image's size whose fully transparent pixels, alpha 0, mark where to edit) and the generations fields
above (read from their text form: ``n``, ``size``, ``model``, ``response_format``, ``output_format``,
``output_compression``, ``stream``, ``user``), plus ``strength`` (not OpenAI's: a number in (0, 1]).
The image is resized (Pillow's Lanczos) to the request's size, ``size`` or the engine's default size,
since the engine makes only its own sizes; the mask with it. With a mask: inpainting of the transparent
part at strength :data:`MASK_STRENGTH` (1.0: the masked part is made anew), every pixel outside it the
resized image's own (the overlay: a1111_images.overlay). Without: image to image of the whole image at
validation.DEFAULT_STRENGTH (0.75, A1111's img2img default; diffusers' SDXL img2img pipeline defaults to 0.3).
The client's bytes are never written to disk (:class:`InMemoryMultiPartParser`) and are decoded only by
uploads.open_image.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from PIL import Image
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from sdxl_engine.engine.validation import DEFAULT_STRENGTH, InvalidRequest, Limits, size_of
from sdxl_engine.service import models
from sdxl_engine.service.delivery import write_served
from sdxl_engine.service.image_prep import overlay
from sdxl_engine.service.images import EXIF_IFD, USER_COMMENT
from sdxl_engine.service.request import Request as ServiceRequest
from sdxl_engine.service.service import Service
from sdxl_engine.serving.apis.core import (
    ApiError,
    FileTokens,
    Generated,
    generate,
    read_json,
    refused_field,
    request_of,
    wait_started,
)
from sdxl_engine.serving.apis.errors import openai_error
from sdxl_engine.serving.apis.uploads import open_image

LOG = logging.getLogger(__name__)

PREFIX = "/v1"
FORMATS = ("b64_json", "url")
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")
# The steps are the model's (OpenAI's body has none): a run over max_run_seconds is the size's to change.
FIELD_NAMES = (("width", "size"), ("height", "size"), ("images", "n"), ("num_inference_steps", "size"))
# Not OpenAI's: the engine's own fields, by their names, in a generations body (the SDK's extra_body): base + refiner
# at a switch of the client's choice, and the hires fix (docs/hires-fix.md); the engine validates them.
EXTENSIONS = ("refiner_switch_at", "hires_scale", "hires_upscaler", "hires_strength", "hires_steps")


def parse_size(size) -> tuple[int, int] | None:
    """``"WxH"`` -> (W, H) pixels; None or ``"auto"`` -> None (the model's default).

    Raises ApiError 400 (param ``size``) for anything else; whether the model makes that size is
    the engine's check (core.check), with its list of sizes.
    """
    if size is None or size == "auto":
        return None
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ApiError(400, f"size: expected \"WIDTHxHEIGHT\" in pixels such as \"1024x1024\", or \"auto\"; "
                            f"got {str(size)[:40]!r}", "size")
    return int(match[1]), int(match[2])


OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # OpenAI's output_format -> Pillow's format
GPT_IMAGE = ("gpt-image-", "chatgpt-image-")  # the name prefixes of OpenAI's GPT image models
DALL_E = ("dall-e-2", "dall-e-3")


@dataclasses.dataclass(frozen=True)
class Answer:
    """How a generations or edits request wants its images: ``response_format`` (b64_json, url),
    ``output_format`` (png, jpeg, webp) with ``compression`` (0-100, for jpeg and webp), ``stream``
    (Server-Sent Events of type ``<event>.completed``: ``image_generation``, or ``image_edit`` for edits),
    and ``warnings``: the fields sent that this server does not honour (:func:`ignored`)."""

    response_format: str = "b64_json"
    output_format: str = "png"
    compression: int = 100
    stream: bool = False
    warnings: tuple[str, ...] = ()
    event: str = "image_generation"
    top_quality: str | None = None  # quality hd/high, if asked: base + refiner where one is loaded (with_quality)


def model_family(model, model_ids) -> str | None:
    """Which model a ``model`` field names: ``"own"`` (left out, or one of ``model_ids``, the models this server
    offers: GET /v1/models), ``"gpt-image"`` (any ``gpt-image-*`` / ``chatgpt-image-*`` name: answers b64_json,
    refuses url, as OpenAI's GPT image models do), ``"dall-e"`` (``dall-e-2``/``dall-e-3``: answers url unless
    asked for b64_json, as OpenAI's DALL-E did); None for any other name. OpenAI's names are the default model."""
    if model in (None, "") or model in model_ids:
        return "own"
    if isinstance(model, str) and model.startswith(GPT_IMAGE):
        return "gpt-image"
    return "dall-e" if model in DALL_E else None


# OpenAI's Images API fields (generations and edits' text fields), and this server's EXTENSIONS: any other field of a
# body is named in the warnings (OpenAI refuses one; clients of SD-style servers send their own, such as steps, here
# ignored, so it is said rather than refused).
KNOWN_FIELDS = ("prompt", "model", "n", "size", "quality", "style", "user", "response_format", "output_format",
                "output_compression", "stream", "partial_images", "background", "moderation", "input_fidelity")


def ignored(body: dict) -> tuple[str, ...]:
    """The warnings for OpenAI fields in ``body`` that would change the images and are not honoured; a
    field left out or at OpenAI's default (``auto``) gives none; a field OpenAI does not have (nor
    :data:`EXTENSIONS`) is named as not a field of this API. OpenAI's response has no place for
    them: the route logs them and sends them in the ``X-SDXL-Warnings`` header."""
    rows = (("quality", ("auto", *TOP_QUALITY), "the steps and size decide the quality here"),
            ("style", (), "no vivid/natural styles here: describe the style in the prompt"),
            ("background", ("auto", "opaque"), "images are opaque RGB here"),
            ("partial_images", (0,), "only the final image is sent here (no partial images)"),
            ("input_fidelity", ("low",), "the image is followed as strength says (0.75 without a mask) here"))
    warnings = [f"{name}={_short(body[name])} ignored: {why}" for name, defaults, why in rows
                if body.get(name) is not None and body[name] not in defaults]
    if body.get("output_compression") not in (None, 100) and (body.get("output_format") or "png") == "png":
        warnings.append(f"output_compression={_short(body['output_compression'])} ignored: "
                        "PNG is lossless (it applies to jpeg and webp)")
    unknown = [_short(name)[1:-1] for name in body if name not in KNOWN_FIELDS + EXTENSIONS]  # JSON keys: text
    if unknown:
        names = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        warnings.append(f"{names} ignored: not fields of the OpenAI Images API (nor of this server's extensions: "
                        f"{', '.join(EXTENSIONS)})")
    return tuple(warnings)


TOP_QUALITY = ("hd", "high")  # OpenAI's best quality (DALL-E 3's hd, GPT image's high): base + refiner here
REFINER_SWITCH = 0.8  # the refiner's share: the last 20 % of the steps (diffusers' and A1111's usual switch)


def with_quality(call: ServiceRequest, answer: Answer, refiner: bool) -> tuple[ServiceRequest, Answer]:
    """(request, answer) with OpenAI's top ``quality`` (:data:`TOP_QUALITY`, ``answer.top_quality``) served: the
    base model and the loaded refiner as an ensemble (``refiner_switch_at`` :data:`REFINER_SWITCH`, kept beside
    any image fields of an edit) when ``refiner`` (the engine has one, validation.Limits.refiner); without one a
    warning (:func:`ignored`'s kind) says it was not honoured. Any other quality: unchanged."""
    if not answer.top_quality or call.engine.refiner_switch_at is not None:
        return call, answer  # another quality, or the client's own refiner_switch_at
    if not refiner:
        why = (f"quality={_short(answer.top_quality)} ignored: no refiner is loaded here to refine with (the server "
               "runs one with --refiner)")
        return call, dataclasses.replace(answer, warnings=(*answer.warnings, why))
    return dataclasses.replace(call, engine=dataclasses.replace(call.engine, refiner_switch_at=REFINER_SWITCH)), answer


def _short(value) -> str:
    """A sent value for a warning (and a header): ASCII JSON, cut to 40 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    """``body[name]`` as a whole number in [lo, hi] (``default`` when left out or null); ApiError 400 otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise ApiError(400, f"{name}: expected a whole number, got {type(value).__name__}", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"{name}: must be between {lo} and {hi}, got {value}", name)
    return value


def to_call(body, model_ids: list[str]) -> tuple[ServiceRequest, Answer]:
    """(the service's request, how to answer) for a generations body (a JSON object); ``model_ids``: the models
    this server offers (service/models.names), the default first: ``model`` naming one is the request's model.

    Raises ApiError: 400 a missing/non-text prompt, a bad ``n``/``size``/``response_format``/
    ``output_format``/``output_compression``/``stream``/``partial_images``, ``url`` asked of a GPT image
    model or with jpeg/webp or a stream; 404 a ``model`` that is neither one of ``model_ids`` nor one of
    OpenAI's names (:func:`model_family`), naming it and the models offered.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "prompt" not in body:
        raise ApiError(400, "prompt: is required", "prompt")
    model = body.get("model")
    family = model_family(model, model_ids)
    if family is None:
        raise ApiError(404, unknown_model(model, model_ids), "model")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int:
        raise ApiError(400, f"n: expected a whole number, got {type(n).__name__}", "n")
    if n < 1:
        raise ApiError(400, f"n: must be at least 1, got {n}", "n")
    fmt = body.get("response_format") or ("url" if family == "dall-e" else "b64_json")
    if fmt not in FORMATS:
        raise ApiError(400, f"response_format: must be one of {', '.join(FORMATS)}, got {str(fmt)[:40]!r}",
                       "response_format")
    if fmt == "url" and family == "gpt-image":
        raise ApiError(400, f"response_format: 'url' is not supported with {model!r}: GPT image models answer "
                            "b64_json (leave response_format out)", "response_format")
    output = body.get("output_format") or "png"
    if output not in OUTPUT_FORMATS:
        raise ApiError(400, f"output_format: must be one of {', '.join(OUTPUT_FORMATS)}, got {str(output)[:40]!r}",
                       "output_format")
    compression = _whole(body, "output_compression", 100, 0, 100)
    _whole(body, "partial_images", 0, 0, 3)
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ApiError(400, f"stream: expected true or false, got {str(stream)[:40]!r}", "stream")
    if fmt == "url" and (output != "png" or stream):
        field = "stream" if stream else "output_format"
        raise ApiError(400, f"{field}: url answers are PNG files, sent whole; ask for response_format b64_json "
                            f"for {'a stream' if stream else output + ' images'}", field)
    width, height = parse_size(body.get("size")) or (None, None)
    fields = {name: body[name] for name in EXTENSIONS if body.get(name) is not None}
    if family == "own" and model not in (None, "", model_ids[0]):
        fields["model"] = model  # another of the server's models; OpenAI's names and the default: None
    call = request_of(FIELD_NAMES, prompt=body["prompt"], width=width, height=height, images=n, **fields)
    return call, Answer(fmt, output, compression, bool(stream), ignored(body),
                        top_quality=body["quality"] if body.get("quality") in TOP_QUALITY else None)


def unknown_model(model, model_ids: list[str]) -> str:
    """The refusal of a ``model`` this server does not have, naming it and the models it offers."""
    return (f"model: unknown model {str(model)[:80]!r}; this server offers: {', '.join(model_ids)} "
            "(GET /v1/models), the first also under OpenAI's names gpt-image-*, dall-e-2, dall-e-3")


def encode(png: bytes, output_format: str, compression: int = 100) -> bytes:
    """One image in ``output_format`` (png, jpeg, webp): the handler's PNG as it is, or re-encoded by
    Pillow at quality ``compression`` (0-100) with the PNG's ``parameters`` text in the EXIF UserComment
    (``UNICODE\\0`` + UTF-16-BE, as A1111's JPEG/WebP and its PNG Info read it)."""
    if output_format == "png":
        return png
    image = Image.open(io.BytesIO(png))
    exif = Image.Exif()
    exif.get_ifd(EXIF_IFD)[USER_COMMENT] = b"UNICODE\0" + image.text.get("parameters", "").encode("utf-16-be")
    out = io.BytesIO()
    image.convert("RGB").save(out, OUTPUT_FORMATS[output_format], quality=compression, exif=exif)
    return out.getvalue()


MASK_STRENGTH = 1.0  # an edit with a mask: the transparent part is made anew (diffusers' inpainting default)
FORM_MAX_FILES = 4  # file parts in an edits form: image (or image[] ...) and mask
FORM_MAX_FIELDS = 50  # text parts: OpenAI's edit fields are fewer than 25
FORM_MAX_TEXT_BYTES = 256 * 1024  # one text part: a prompt of validation.MAX_PROMPT_CHARS in 4-byte UTF-8, and more
FORM_WHOLE = ("n", "output_compression", "partial_images")  # text fields read as whole numbers
FILE_FIELDS = ("image", "image[]", "mask", "markup")
TEXT_FIELDS = ("prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "stream",
               "user", "strength", "quality", "background", "partial_images", "input_fidelity", "moderation")


class InMemoryMultiPartParser(MultiPartParser):
    """Starlette's multipart parser (the one ``Request.form`` uses, with its part, file and field limits) with
    every file part kept in memory. Starlette keeps a file part in a ``SpooledTemporaryFile`` that moves to a
    file on disk past ``spool_max_size`` (1 MB there); a client's image is not written to disk here, so this
    spool has no such size (tempfile's rule: ``max_size`` 0 never rolls over). The body is bounded before it
    is read: the HTTP guard caps it at guard.MAX_IMAGE_BODY_BYTES (48 MB) on ``/v1/images/edits``."""

    spool_max_size = 0


@dataclasses.dataclass(frozen=True)
class EditUpload:
    """An edits form's files and image fields, not yet decoded: ``image`` (the first image's bytes), ``mask``
    (the mask's bytes, or None), ``strength`` (the form's, or None for the default)."""

    image: bytes
    mask: bytes | None = None
    strength: float | None = None


async def read_form(request: Request) -> FormData:
    """The request's multipart/form-data body, read in memory (:class:`InMemoryMultiPartParser`) with at most
    :data:`FORM_MAX_FILES` files, :data:`FORM_MAX_FIELDS` text fields of :data:`FORM_MAX_TEXT_BYTES` each.
    The caller closes it (``await form.close()``).

    Raises ApiError 400: another Content-Type, a form that breaks these limits or cannot be parsed."""
    kind = request.headers.get("content-type", "")
    if kind.partition(";")[0].strip().lower() != "multipart/form-data":
        raise ApiError(400, "the request body must be multipart/form-data (an image file and text fields, as "
                            f"openai's images.edit sends them), got {_short(kind) if kind else 'no Content-Type'}")
    parser = InMemoryMultiPartParser(request.headers, request.stream(), max_files=FORM_MAX_FILES,
                                     max_fields=FORM_MAX_FIELDS, max_part_size=FORM_MAX_TEXT_BYTES)
    try:
        return await parser.parse()
    except ClientDisconnect:  # the client left, or the guard cut a body over its cap (it answers the 413)
        raise ApiError(400, "the request body ended before the form did") from None
    except MultiPartException as err:
        raise ApiError(400, f"the multipart form could not be read: {err.message}") from None


def edit_form(form: FormData, model_ids: list[str]) -> tuple[ServiceRequest, Answer, EditUpload]:
    """(the service's request without its image, how to answer, the files) for an edits form.

    Text fields are read as generations' JSON fields (:func:`to_call`: every check and refusal is its): ``n``,
    ``output_compression`` and ``partial_images`` as whole numbers, ``stream`` ``true``/``false``; an empty
    text field counts as left out. The image is ``image``, or the first ``image[]`` (any others, and a
    ``markup`` file, are named in the answer's warnings). The answer's stream events are ``image_edit``'s.

    Raises ApiError: to_call's; 400 no image (param ``image``), a file where text belongs (:data:`TEXT_FIELDS`) or
    text where a file does (naming the field), a number field that is not one, ``strength`` or
    ``refiner_switch_at`` not a number, a hires fix field (generations only).
    """
    text, files = {}, {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name in TEXT_FIELDS:
                raise ApiError(400, f"{name}: expected text, got a file", name)
            files.setdefault(name, []).append(value)  # a file of another name is not read (as unknown text)
        elif name in FILE_FIELDS:
            raise ApiError(400, f"{name}: expected an image file (a form part with a filename), got text", name)
        elif value != "":
            text.setdefault(name, value)
    for name in EXTENSIONS:
        if name.startswith("hires_") and name in text:
            raise ApiError(400, f"{name}: the hires fix applies to generations (POST /v1/images/generations); an "
                                "edit is made at its size", name)
    body = {name: _form_value(name, value) for name, value in text.items() if name != "strength"}
    if "refiner_switch_at" in body:
        try:
            body["refiner_switch_at"] = float(body["refiner_switch_at"])
        except ValueError:
            raise ApiError(400, f"refiner_switch_at: expected a number in [0, 1), got "
                                f"{_short(body['refiner_switch_at'])}", "refiner_switch_at") from None
    call, answer = to_call(body, model_ids)
    images = files.get("image", []) + files.get("image[]", [])
    if not images:
        raise ApiError(400, "image: is required (the image to edit, a PNG, JPEG or WebP file)", "image")
    warnings = list(answer.warnings)
    if len(images) > 1:
        warnings.append(f"{'image[]' if 'image[]' in files else 'image'}: {len(images)} images sent, the first one "
                        "edited: this server edits one image per request")
    if "markup" in files:
        warnings.append("markup ignored: the prompt and the mask say what to change here")
    strength = None
    if "strength" in text:
        try:
            strength = float(text["strength"])
        except ValueError:
            raise ApiError(400, f"strength: expected a number in (0, 1], got {_short(text['strength'])}",
                           "strength") from None
    masks = files.get("mask", [])
    upload = EditUpload(_read(images[0]), _read(masks[0]) if masks else None, strength)
    return call, dataclasses.replace(answer, warnings=tuple(warnings), event="image_edit"), upload


def _form_value(name: str, value: str):
    """A text field's value as generations' JSON would carry it (see :func:`edit_form`)."""
    if name in FORM_WHOLE:
        try:
            return int(value.strip())
        except ValueError:
            raise ApiError(400, f"{name}: expected a whole number, got {_short(value)}", name) from None
    if name == "stream":
        if value.strip().lower() not in ("true", "false"):
            raise ApiError(400, f"stream: expected true or false, got {_short(value)}", "stream")
        return value.strip().lower() == "true"
    return value


def _read(upload: UploadFile) -> bytes:
    """A file part's bytes: in memory (InMemoryMultiPartParser), so a plain read does not block."""
    upload.file.seek(0)
    return upload.file.read()


def edit_call(call: ServiceRequest, upload: EditUpload, limits: Limits) -> ServiceRequest:
    """``call`` (from :func:`edit_form`) with its image: the uploaded image, decoded by uploads.open_image and
    resized with Pillow's Lanczos to the request's size (``size``, or ``limits.default_size``), since the engine
    makes only sizes of its own; and its mask, if one came (:func:`edit_mask`). Its engine request carries
    ``image`` (H, W, 3) uint8, ``strength`` (the form's; else :data:`MASK_STRENGTH` with a mask,
    validation.DEFAULT_STRENGTH without) and with a mask ``mask`` (H, W) uint8 (255 = repaint); its
    ``paste_back`` the overlay (the resized image, alpha 1.0 where repainted, 0.0 elsewhere: every pixel outside
    the mask stays the image's). Blocking (decoding, resizing): run it in a thread.

    Raises ApiError 400: a size the engine does not make (param ``size``, the engine's message); uploads'
    refusals naming ``image`` or ``mask``; :func:`edit_mask`'s.
    """
    try:
        width, height = size_of(call.engine.width or limits.default_size[0],
                                call.engine.height or limits.default_size[1], limits)
    except InvalidRequest as err:
        raise refused_field(err, call) from None
    image = open_image(upload.image, "image", "RGB")
    repaint = None if upload.mask is None else edit_mask(open_image(upload.mask, "mask", None), image.size,
                                                         (width, height))
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    pixels = np.asarray(image, dtype=np.uint8)  # (H, W, 3)
    if repaint is None:
        strength = DEFAULT_STRENGTH if upload.strength is None else upload.strength
        engine = dataclasses.replace(call.engine, width=width, height=height, image=pixels, strength=strength)
        return dataclasses.replace(call, engine=engine)
    strength = MASK_STRENGTH if upload.strength is None else upload.strength
    engine = dataclasses.replace(call.engine, width=width, height=height, image=pixels, mask=repaint, strength=strength)
    return dataclasses.replace(call, engine=engine, paste_back=overlay(pixels, (repaint == 255).astype(np.float32)))


def edit_mask(mask: Image.Image, image_size: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """OpenAI's edit mask as the engine's: (H, W) uint8 at ``size`` (width, height), 255 where ``mask``'s alpha
    is 0 (fully transparent: edit), 0 elsewhere (keep). ``mask`` (any mode, as decoded) must have an alpha
    channel (or a transparent colour) and be ``image_size``; its edit area is resized with Lanczos and cut at
    128 (as validation.as_masks binarizes at 0.5).

    Raises ApiError 400 naming ``mask``: no alpha, another size than the image, no fully transparent pixel
    (or none left at ``size``).
    """
    if mask.size != image_size:
        raise ApiError(400, f"mask: is {mask.size[0]}x{mask.size[1]} pixels, the image {image_size[0]}x"
                            f"{image_size[1]}: send a mask of the image's size", "mask")
    if mask.mode not in ("RGBA", "LA", "PA", "RGBa", "La") and "transparency" not in mask.info:
        raise ApiError(400, f"mask: has no alpha channel (mode {mask.mode}): send a PNG with transparency, fully "
                            "transparent (alpha 0) where the image is to be edited", "mask")
    edit = Image.fromarray(np.where(np.asarray(mask.convert("RGBA"))[..., 3] == 0, 255, 0).astype(np.uint8), "L")
    if edit.size != size:
        edit = edit.resize(size, Image.Resampling.LANCZOS)
    repaint = np.where(np.asarray(edit) >= 128, 255, 0).astype(np.uint8)  # (H, W)
    if not repaint.any():
        where = "" if mask.size == size else f" at the request's size {size[0]}x{size[1]}"
        raise ApiError(400, f"mask: no fully transparent pixel (alpha 0){where}, so nothing to edit: make the "
                            "area to edit transparent", "mask")
    return repaint


FILES = PREFIX + "/images/files/"


def files_router(tokens: FileTokens) -> APIRouter:
    """``GET /v1/images/files/<token>.png``: the PNG a ``response_format=url`` answer named."""
    api = APIRouter()

    @api.get(FILES + "{token}.png")
    async def image_file(token: str):
        path = tokens.path(token)
        if path is None:
            return openai_error(ApiError(404, "no such image (unknown, or deleted from the server's temp folder)"))
        return FileResponse(path, media_type="image/png")

    @api.get(FILES + "{name:path}", include_in_schema=False)
    async def not_an_image_name(name: str):  # every name this route serves is <token>.png
        return openai_error(ApiError(404, f"no such image: {FILES}{ascii(name)[1:-1][:80]} (the server's image "
                                          f"names are {FILES}<token>.png, as a url answer gives them)"))

    return api


def router(requests: Service, tokens: FileTokens, owner_of: Callable, files_dir: Callable[[], str]) -> APIRouter:
    """The ``/v1`` image routes, generating through ``requests`` (service.Service) as jobs of the front "openai"
    owned by ``owner_of(request)`` (core.owner_of); ``tokens`` names the PNGs of ``url`` answers (served by
    :func:`files_router`), written under ``files_dir()`` (the only answers that make files)."""
    api = APIRouter(prefix=PREFIX)
    engine = requests.engine

    def model_ids() -> list[str]:  # the models offered, the default first
        return models.names(engine)

    def refused(route: str, err: ApiError) -> JSONResponse:
        """A request refused before it reached the service (which logs its own refusals): one log line, then
        OpenAI's error shape."""
        LOG.info(f"[app] request refused: {PREFIX}/{route}: {err.message}")
        return openai_error(err)

    @api.post("/images/generations")
    async def generations(request: Request):
        try:
            call, answer = to_call(read_json(await request.body()), model_ids())
            await wait_started(engine)
            call, answer = with_quality(call, answer, engine.limits is not None and engine.limits.refiner)
        except ApiError as err:
            return refused("images/generations", err)
        try:
            made = await _generate(requests, request, call, answer, owner_of(request))
        except ApiError as err:
            return openai_error(err)
        return await respond(request, made, answer, tokens, files_dir)

    decoding = asyncio.Lock()  # one edit's images decoded at a time: each holds up to 2048 x 2048 pixels

    @api.post("/images/edits")
    async def edits(request: Request):
        try:
            form = await read_form(request)
            try:
                call, answer, upload = edit_form(form, model_ids())
            finally:
                await form.close()
            await wait_started(engine)
            if engine.error is not None:
                raise ApiError(503, f"the engine failed to start: {engine.error}")
            call, answer = with_quality(call, answer, engine.limits.refiner)
            async with decoding:
                call = await asyncio.to_thread(edit_call, call, upload, engine.limits)
            del upload  # the call holds the decoded image now; the file's bytes can go
        except ApiError as err:
            return refused("images/edits", err)
        try:
            made = await _generate(requests, request, call, answer, owner_of(request))
        except ApiError as err:
            return openai_error(err)
        return await respond(request, made, answer, tokens, files_dir)

    @api.get("/models")
    async def list_models():
        return {"object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sdxl_engine"}
                         for name in model_ids()]}

    @api.get("/models/{name:path}")
    async def model(name: str):
        if model_family(name, model_ids()) is None:
            return openai_error(ApiError(404, unknown_model(name, model_ids()), "model"))
        return {"id": name, "object": "model", "created": 0, "owned_by": "sdxl_engine"}

    return api


async def _generate(requests: Service, request: Request, call: ServiceRequest, answer: Answer,
                    owner: str) -> Generated:
    """core.generate for a route's call, after one log line naming the fields it does not honour."""
    if answer.warnings:
        LOG.info(f"[app] OpenAI images: {len(answer.warnings)} field(s) not honoured: {'; '.join(answer.warnings)}")
    return await generate(requests, request, call, "openai", owner)


async def respond(request: Request, made: Generated, answer: Answer, tokens: FileTokens,
                  files_dir: Callable[[], str]) -> Response:
    """OpenAI's answer for ``made`` as ``answer`` says (generations and edits alike): a JSON ImagesResponse
    (``b64_json`` or ``url`` items), or a stream of ``<answer.event>.completed`` events; the warnings in the
    ``X-SDXL-Warnings`` header, with the stop's message when the request was stopped after some of its images (those
    are answered: OpenAI has no stop, so nothing else would tell the client that fewer images came)."""
    warnings = [*answer.warnings]
    if made.stopped:
        warnings.append(f"stopped after {len(made.pngs)} image(s): {made.stopped}")
    # a header is latin-1: anything else (a prompt's word quoted in a warning) as "?"
    headers = {"X-SDXL-Warnings": "; ".join(warnings).encode("ascii", "replace").decode()} if warnings else {}
    made_at = made.info.get("hires") or made.info  # a hires fix's images are its second pass's size
    size = f"{made_at['width']}x{made_at['height']}"
    images = [] if answer.response_format == "url" else made.pngs if answer.output_format == "png" else \
        await asyncio.to_thread(lambda: [encode(p, answer.output_format, answer.compression) for p in made.pngs])
    if answer.stream:
        return StreamingResponse(_events(images, answer, size), media_type="text/event-stream", headers=headers)
    if answer.response_format == "b64_json":
        data = [{"b64_json": base64.b64encode(image).decode(), "revised_prompt": None} for image in images]
    else:
        base = str(request.base_url).rstrip("/")
        paths = await asyncio.to_thread(write_served, made.pngs, made.stems, Path(files_dir()))
        data = [{"url": f"{base}{FILES}{tokens.add(path)}.png", "revised_prompt": None} for path in paths]
    return JSONResponse({"created": int(time.time()), "data": data, "output_format": answer.output_format,
                         "size": size}, headers=headers)


async def _events(images: list[bytes], answer: Answer, size: str):
    """OpenAI's image stream (openai.types.ImageGenStreamEvent, or ImageEditStreamEvent for edits) for finished
    images: one ``<answer.event>.completed`` Server-Sent Event per image, in order (no partial images)."""
    kind = f"{answer.event}.completed"
    for image in images:
        event = {"type": kind, "b64_json": base64.b64encode(image).decode(),
                 "created_at": int(time.time()), "size": size, "output_format": answer.output_format,
                 "quality": "auto", "background": "opaque",
                 "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                           "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}}
        yield f"event: {kind}\ndata: {json.dumps(event)}\n\n"


def unknown_router() -> APIRouter:
    """Any other ``/v1`` path or method, in OpenAI's error shape (FastAPI's own would be ``{"detail": ...}``);
    mounted after every /v1 route (apis.mount), so it answers only what they do not."""
    api = APIRouter(prefix=PREFIX)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        return openai_error(ApiError(404, f"{request.method} {PREFIX}/{path[:80]} is not served here; this server "
                                          f"has POST {PREFIX}/images/generations, POST {PREFIX}/images/edits, "
                                          f"GET {PREFIX}/models, GET {FILES}<name>.png, and the jobs API: POST and "
                                          f"GET {PREFIX}/jobs, GET and DELETE {PREFIX}/jobs/<id>, "
                                          f"GET {PREFIX}/jobs/<id>/events"))

    return api
