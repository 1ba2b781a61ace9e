"""OpenAI's Images API on this server: ``POST /v1/images/generations``, ``GET /v1/models``.

``POST /v1/images/generations`` runs the page's ``/generate`` event (core.generate: same queue,
handler, checks and messages). Fields (:func:`to_call`): ``prompt``; ``n`` images (default 1; the
engine makes its batch per call, fewer return the first ones, more run further calls);
``size`` ``"WxH"`` (one of the model's sizes; ``"auto"`` or left out: its default); ``model``
(left out, or the loaded model's id from ``GET /v1/models``); ``response_format`` ``b64_json``
(default here) or ``url`` (``/v1/images/files/<token>.png`` on this server, an unguessable name
for the PNG, valid while the temp folder keeps it); ``output_format`` ``png`` (default), ``jpeg`` or
``webp`` with ``output_compression`` (0-100, the encoder's quality; the parameters text goes in the
EXIF UserComment, as A1111 writes it); ``stream`` (Server-Sent Events: one
``image_generation.completed`` event per image, no partial images); ``user`` (accepted, not stored).
OpenAI's model names (``gpt-image-*``, ``dall-e-2``, ``dall-e-3``) are served as aliases of the
loaded model, answering as that model does by default (:func:`model_family`). Other fields that
would change the images (``quality``, ``style``, ``background``, ``partial_images``) are not
honoured: each is named in one log line and the ``X-SDXL-Warnings`` header (:func:`ignored`).
Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with its
statuses (400 bad value, 401 key, 404 model, 429 over the per-client limit, 500/503 server).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import re
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from PIL import Image

from sdxl_engine.serving import admission
from sdxl_engine.serving.apis.core import ApiError, Call, FileTokens, generate, model_name, read_json

PREFIX = "/v1"
FORMATS = ("b64_json", "url")
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")
FIELD_NAMES = (("width", "size"), ("height", "size"), ("images", "n"))
ERROR_TYPES = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
               403: ("invalid_request_error", "api_off"), 404: ("invalid_request_error", None),
               409: ("invalid_request_error", "interrupted"), 429: ("requests", "rate_limit_exceeded"),
               500: ("server_error", None),
               503: ("server_error", "service_unavailable")}


def openai_error(err: ApiError) -> JSONResponse:
    """``err`` in OpenAI's error shape and status (``type``/``code`` as OpenAI's own errors name them)."""
    kind, code = ERROR_TYPES.get(err.status, ("server_error", None))
    if err.status == 404 and err.param == "model":
        code = "model_not_found"
    return JSONResponse({"error": {"message": err.message, "type": kind, "param": err.param, "code": code}},
                        status_code=err.status, headers=err.headers)


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
USER_COMMENT = 0x9286  # EXIF UserComment, in the Exif IFD (0x8769): where A1111 keeps the parameters of a JPEG/WebP
EXIF_IFD = 0x8769


@dataclasses.dataclass(frozen=True)
class Answer:
    """How a generations request wants its images: ``response_format`` (b64_json, url), ``output_format``
    (png, jpeg, webp) with ``compression`` (0-100, for jpeg and webp), ``stream`` (Server-Sent Events),
    and ``warnings``: the fields sent that this server does not honour (:func:`ignored`)."""

    response_format: str = "b64_json"
    output_format: str = "png"
    compression: int = 100
    stream: bool = False
    warnings: tuple[str, ...] = ()


def model_family(model, model_id: str) -> str | None:
    """Which model a ``model`` field names: ``"own"`` (left out, or ``model_id``, the loaded model),
    ``"gpt-image"`` (any ``gpt-image-*`` / ``chatgpt-image-*`` name: answers b64_json, refuses url, as
    OpenAI's GPT image models do), ``"dall-e"`` (``dall-e-2``/``dall-e-3``: answers url unless asked
    for b64_json, as OpenAI's DALL-E did); None for any other name. All of them are the loaded model."""
    if model in (None, "", model_id):
        return "own"
    if isinstance(model, str) and model.startswith(GPT_IMAGE):
        return "gpt-image"
    return "dall-e" if model in DALL_E else None


def ignored(body: dict) -> tuple[str, ...]:
    """The warnings for OpenAI fields in ``body`` that would change the images and are not honoured; a
    field left out or at OpenAI's default (``auto``) gives none. OpenAI's response has no place for
    them: the route logs them and sends them in the ``X-SDXL-Warnings`` header."""
    rows = (("quality", ("auto",), "the steps and size decide the quality here"),
            ("style", (), "no vivid/natural styles here: describe the style in the prompt"),
            ("background", ("auto", "opaque"), "images are opaque RGB here"),
            ("partial_images", (0,), "only the final image is sent here (no partial images)"))
    warnings = [f"{name}={_short(body[name])} ignored: {why}" for name, defaults, why in rows
                if body.get(name) is not None and body[name] not in defaults]
    if body.get("output_compression") not in (None, 100) and (body.get("output_format") or "png") == "png":
        warnings.append(f"output_compression={_short(body['output_compression'])} ignored: "
                        "PNG is lossless (it applies to jpeg and webp)")
    return tuple(warnings)


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


def to_call(body, model_id: str) -> tuple[Call, Answer]:
    """(the ``/generate`` call, how to answer) for a generations body (a JSON object).

    Raises ApiError: 400 a missing/non-text prompt, a bad ``n``/``size``/``response_format``/
    ``output_format``/``output_compression``/``stream``/``partial_images``, ``url`` asked of a GPT image
    model or with jpeg/webp or a stream; 404 a ``model`` that is neither ``model_id`` nor one of
    OpenAI's names (:func:`model_family`).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "prompt" not in body:
        raise ApiError(400, "prompt: is required", "prompt")
    model = body.get("model")
    family = model_family(model, model_id)
    if family is None:
        raise ApiError(404, f"model: {str(model)[:80]!r} is not served here; this server has {model_id!r} "
                            "(GET /v1/models), also under OpenAI's names gpt-image-*, dall-e-2, dall-e-3", "model")
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
    call = Call(prompt=body["prompt"], width=width, height=height, images=n, field_names=FIELD_NAMES)
    return call, Answer(fmt, output, compression, bool(stream), ignored(body))


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

    return api


def router(demo, engine, tokens: FileTokens) -> APIRouter:
    """The ``/v1`` routes for ``demo``'s ``/generate`` and ``engine``; ``tokens`` names the PNGs of
    ``url`` answers (served by :func:`files_router`)."""
    api = APIRouter(prefix=PREFIX)

    def model_id() -> str:
        return model_name(engine)

    @api.post("/images/generations")
    async def generations(request: Request):
        try:
            call, answer = to_call(read_json(await request.body()), model_id())
            if answer.warnings:
                print(f"[app] OpenAI images: {len(answer.warnings)} field(s) not honoured: "
                      f"{'; '.join(answer.warnings)}", flush=True)
            made = await generate(demo, engine, request, call, ("openai", admission.client_address(request)))
        except ApiError as err:
            return openai_error(err)
        headers = {"X-SDXL-Warnings": "; ".join(answer.warnings)} if answer.warnings else {}
        size = f"{made.info['width']}x{made.info['height']}"
        images = [] if answer.response_format == "url" else made.pngs if answer.output_format == "png" else \
            await asyncio.to_thread(lambda: [encode(p, answer.output_format, answer.compression) for p in made.pngs])
        if answer.stream:
            return StreamingResponse(_events(images, answer, size), media_type="text/event-stream", headers=headers)
        if answer.response_format == "b64_json":
            data = [{"b64_json": base64.b64encode(image).decode(), "revised_prompt": None} for image in images]
        else:
            base = str(request.base_url).rstrip("/")
            data = [{"url": f"{base}{FILES}{tokens.add(path)}.png", "revised_prompt": None}
                    for path in made.paths]
        return JSONResponse({"created": int(time.time()), "data": data, "output_format": answer.output_format,
                             "size": size}, headers=headers)

    @api.get("/models")
    async def models():
        return {"object": "list",
                "data": [{"id": model_id(), "object": "model", "created": 0, "owned_by": "sdxl_engine"}]}

    @api.get("/models/{name:path}")
    async def model(name: str):
        if model_family(name, model_id()) is None:
            return openai_error(ApiError(404, f"model: {name[:80]!r} is not served here; this server has "
                                              f"{model_id()!r}", "model"))
        return {"id": name, "object": "model", "created": 0, "owned_by": "sdxl_engine"}

    return api


async def _events(images: list[bytes], answer: Answer, size: str):
    """OpenAI's image stream (openai.types.ImageGenStreamEvent) for finished images: one
    ``image_generation.completed`` Server-Sent Event per image, in order (no partial images)."""
    for image in images:
        event = {"type": "image_generation.completed", "b64_json": base64.b64encode(image).decode(),
                 "created_at": int(time.time()), "size": size, "output_format": answer.output_format,
                 "quality": "auto", "background": "opaque",
                 "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                           "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}}
        yield f"event: image_generation.completed\ndata: {json.dumps(event)}\n\n"


def unknown_router() -> APIRouter:
    """Any other ``/v1`` path or method, in OpenAI's error shape (FastAPI's own would be ``{"detail": ...}``);
    mounted after every /v1 route (apis.mount), so it answers only what they do not."""
    api = APIRouter(prefix=PREFIX)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        return openai_error(ApiError(404, f"{request.method} {PREFIX}/{path[:80]} is not served here; this server "
                                          f"has POST {PREFIX}/images/generations, GET {PREFIX}/models"))

    return api
