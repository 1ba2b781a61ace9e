"""OpenAI's Images API on this server: ``POST /v1/images/generations``, ``GET /v1/models``.

``POST /v1/images/generations`` runs the page's ``/generate`` event (core.generate: same queue,
handler, checks and messages). Fields (:func:`to_call`): ``prompt``; ``n`` images (default 1; the
engine makes its batch per call, fewer return the first ones, more run further calls);
``size`` ``"WxH"`` (one of the model's sizes; ``"auto"`` or left out: its default); ``model``
(left out, or the loaded model's id from ``GET /v1/models``); ``response_format`` ``b64_json``
(default here) or ``url`` (``/v1/images/files/<token>.png`` on this server, an unguessable name
for the PNG, valid while the temp folder keeps it); ``user`` (accepted, not stored). OpenAI's
other fields (``quality``, ``style``, ``background`` ...) are ignored. Errors come in OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, with its statuses (400 bad value,
401 key, 404 model, 429 over the per-client limit, 500/503 server).
"""

from __future__ import annotations

import base64
import re
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from sdxl_engine.serving.apis.core import client_of, ApiError, Call, FileTokens, generate, model_name

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


def to_call(body, model_id: str) -> tuple[Call, str]:
    """(the ``/generate`` call, the response format) for a generations body (a JSON object).

    Raises ApiError: 400 a missing/non-text prompt, a bad ``n``/``size``/``response_format``; 404
    a ``model`` other than ``model_id``.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "prompt" not in body:
        raise ApiError(400, "prompt: is required", "prompt")
    model = body.get("model")
    if model not in (None, "", model_id):
        raise ApiError(404, f"model: {str(model)[:80]!r} is not served here; this server has {model_id!r} "
                            "(GET /v1/models)", "model")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int:
        raise ApiError(400, f"n: expected a whole number, got {type(n).__name__}", "n")
    if n < 1:
        raise ApiError(400, f"n: must be at least 1, got {n}", "n")
    fmt = body.get("response_format") or "b64_json"
    if fmt not in FORMATS:
        raise ApiError(400, f"response_format: must be one of {', '.join(FORMATS)}, got {str(fmt)[:40]!r}",
                       "response_format")
    width, height = parse_size(body.get("size")) or (None, None)
    return Call(prompt=body["prompt"], width=width, height=height, images=n, field_names=FIELD_NAMES), fmt


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
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "the request body is not JSON") from None
            call, fmt = to_call(body, model_id())
            made = await generate(demo, engine, request, call, ("openai", client_of(request)))
        except ApiError as err:
            return openai_error(err)
        if fmt == "b64_json":
            data = [{"b64_json": base64.b64encode(png).decode(), "revised_prompt": None} for png in made.pngs]
        else:
            base = str(request.base_url).rstrip("/")
            data = [{"url": f"{base}{FILES}{tokens.add(path)}.png", "revised_prompt": None}
                    for path in made.paths]
        return {"created": int(time.time()), "data": data, "output_format": "png",
                "size": f"{made.info['width']}x{made.info['height']}"}

    @api.get("/models")
    async def models():
        return {"object": "list",
                "data": [{"id": model_id(), "object": "model", "created": 0, "owned_by": "sdxl_engine"}]}

    @api.get("/models/{name:path}")
    async def model(name: str):
        if name != model_id():
            return openai_error(ApiError(404, f"model: {name[:80]!r} is not served here; this server has "
                                              f"{model_id()!r}", "model"))
        return {"id": name, "object": "model", "created": 0, "owned_by": "sdxl_engine"}

    return api


def unknown_router() -> APIRouter:
    """Any other ``/v1`` path or method, in OpenAI's error shape (FastAPI's own would be ``{"detail": ...}``);
    mounted after every /v1 route (apis.mount), so it answers only what they do not."""
    api = APIRouter(prefix=PREFIX)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        return openai_error(ApiError(404, f"{request.method} {PREFIX}/{path[:80]} is not served here; this server "
                                          f"has POST {PREFIX}/images/generations, GET {PREFIX}/models"))

    return api
