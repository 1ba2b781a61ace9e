"""The protocols other clients speak, on the page's own server: AUTOMATIC1111's API (a1111.py),
OpenAI's Images API (openai_images.py), the jobs API (jobs.py) and MCP (mcp_server.py, ``/gradio_api/mcp/``).

Each is a front of the service (service.Service): every generation is one of its jobs, so all of them share the
page's engine, slots, per-client cap, checks and messages.

Access (:func:`access_for`, from the flags ``--api-key`` / ``SDXL_API_KEY``, ``--public-api``,
``--no-mcp``): with a key, ``/sdapi``, ``/v1`` and ``/gradio_api/mcp`` need
``Authorization: Bearer <key>`` (or HTTP Basic with the key as password: :func:`key_refusal`);
without one they are open, except behind a share link (``--share``), where they are off unless
``--public-api`` says otherwise (a share link is public, and these APIs have no page in front of
them). :func:`mount` adds the routes to the launched app; the start-up log says which are on
(:attr:`Access.line`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import secrets

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from sdxl_engine.serving import admission, gradio_internals
from sdxl_engine.serving.apis import a1111, controlnet, core, jobs, mcp_server, openai_images
from sdxl_engine.serving.apis.core import ApiError, FileTokens
from sdxl_engine.serving.guard import CONTROLNET, MCP_PATH, PROTOCOL_PREFIXES, SAFE_METHODS, cross_site_refusal

LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Access:
    """Which protocol APIs serve, and the key they need.

    ``apis``: ``/sdapi/v1`` and ``/v1`` are served (else they answer 403 with ``off_reason``);
    ``mcp``: the MCP server (mcp_server.py) serves; ``key``: the Bearer token they need ("" = none; never logged).
    """

    apis: bool
    mcp: bool
    key: str = dataclasses.field(default="", repr=False)  # a repr (a traceback, a log) never shows it
    off_reason: str = ""

    @property
    def line(self) -> str:
        """The start-up log line: what is served and how it is protected (never the key)."""
        guard = "API key required (Authorization: Bearer)" if self.key else "no API key"
        if not self.apis:
            return f"[app] protocol APIs off: {self.off_reason}"
        mcp = f", MCP at {MCP_PATH}/" if self.mcp else ", MCP off"
        return (f"[app] protocol APIs on: AUTOMATIC1111 at {a1111.PREFIX}, OpenAI Images at {openai_images.PREFIX}"
                f"{mcp}; {guard}")


def access_for(key: str | None, share: bool, public_api: bool, mcp: bool = True) -> Access:
    """The APIs' access for the flags (see the module docstring); ``share``: a share link is open."""
    key = (key or "").strip()
    if share and not key and not public_api:
        return Access(False, False, "", "a share link is open and no API key is set: start with --api-key KEY "
                                        "(or SDXL_API_KEY), or --public-api to serve them without one")
    return Access(True, mcp, key)


def key_refusal(access: Access, headers) -> str | None:
    """Why a request with ``headers`` may not use the APIs, or None. Compares in constant time.

    ``Authorization: Bearer <key>``; also HTTP Basic with the key as the password (any user name),
    which is how AUTOMATIC1111's ``--api-auth`` is sent by Open WebUI, SillyTavern and webuiapi's set_auth.
    """
    if not access.key:
        return None
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    token = token.strip()
    if scheme.lower() == "basic" and token:
        try:
            token = base64.b64decode(token, validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            token = ""
    elif scheme.lower() != "bearer":
        token = ""
    if not token:
        return "this server needs an API key: send the header Authorization: Bearer <key>"
    if not secrets.compare_digest(token.encode(), access.key.encode()):
        return "the API key is wrong"
    return None


def loras_of(engine):
    """``() -> (names, reason)`` for A1111's ``/loras``: the LoRAs the engine loaded at start (its
    ``limits.loras``, which the page's and every API's <lora:NAME:WEIGHT> tags are checked against)."""

    def loras():
        names = tuple(getattr(engine.limits, "loras", ()) or ())
        return names, "" if names else "no LoRAs are loaded (start the server with --lora NAME=PATH or --lora-dir DIR)"

    return loras


def mount(app, requests, access: Access, flags: dict, config=None, log=LOG.info) -> list:
    """Add the protocol routes to Gradio's ``app``, their key check and their cross-site refusal
    (:class:`CrossSiteGuard`; guard.Guard refuses the same on every other route) (server.serve's ``on_launch``:
    before the server listens). The routes generate through ``requests`` (service.Service): A1111, OpenAI Images,
    the jobs API and MCP are its fronts. ``config``: the page's resolved EngineConfig (handler.page_defaults), the
    MCP tools' defaults (None: the engine's config as it is).

    The routes go after Gradio's own (none of which starts with ``/sdapi``, ``/v1``, ``/internal`` or
    ``/gradio_api/mcp``). With the APIs off, both prefixes answer 403 with the reason, in each protocol's error
    shape. Returns the async context managers the app's lifespan must enter before the first request
    (server.before_listening): the MCP server's session manager.
    """
    gradio_internals.add_outermost_middleware(app, CrossSiteGuard)
    if not access.apis:
        app.include_router(_off_router(access.off_reason))
        log(access.line)
        return []
    tokens = FileTokens()

    def owner_of(request) -> str:
        return core.owner_of(request, access.key)

    # A1111's progress, interrupt and skip (and its task ids) are the caller's address's, key or not, as A1111's
    # clients share one key (--api-auth) and must not stop each other's requests
    app.include_router(a1111.router(requests, flags, loras_of(requests.engine), admission.client_address))
    app.include_router(a1111.internal_router(requests, admission.client_address))
    app.include_router(controlnet.router(requests.engine))  # sd-webui-controlnet's /controlnet/* routes
    app.include_router(a1111.unknown_router())  # after every /sdapi/v1 route: only what none answers
    app.include_router(jobs.router(requests, owner_of, flags.get("callback_hosts", ())))
    app.include_router(openai_images.router(requests, tokens, owner_of, gradio_internals.upload_folder))
    app.include_router(openai_images.files_router(tokens))
    app.include_router(openai_images.unknown_router())  # last: only what no /v1 route answers
    contexts = []
    if access.mcp:
        mcp = mcp_server.McpServer(requests, config if config is not None else requests.engine.config, owner_of)
        mcp.mount(app)
        contexts.append(mcp.running())
        gradio_internals.add_outermost_middleware(app, McpArguments)
    if access.key:
        gradio_internals.add_outermost_middleware(app, KeyGuard, access=access)
    log(access.line)
    return contexts


class KeyGuard:
    """ASGI middleware: ``/sdapi``, ``/v1`` (the jobs API included), A1111's ``/internal`` and ``/gradio_api/mcp``
    need the API key (:func:`key_refusal`);
    a refusal is a 401 in the protocol's error shape. The PNG URLs of ``response_format=url`` are
    exempt: they are capabilities (unguessable names) that browsers fetch without headers."""

    def __init__(self, app, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith((a1111.PREFIX + "/", openai_images.PREFIX + "/", "/internal/", CONTROLNET, MCP_PATH)) \
                and not path.startswith(openai_images.FILES):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
            if (reason := key_refusal(self.access, headers)) is not None:
                err = ApiError(401, reason, headers={"WWW-Authenticate": "Bearer"})
                response = a1111.a1111_error(err) if path.startswith((a1111.PREFIX, "/internal/", CONTROLNET)) \
                    else openai_images.openai_error(err)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class CrossSiteGuard:
    """ASGI middleware: a state-changing request (POST ...) to ``/sdapi`` or ``/v1`` that looks sent by another
    site's page (guard.cross_site_refusal: the rule of every route) is a 403 in the protocol's error shape,
    before any route runs. Every other path (Gradio's routes, MCP) is the HTTP guard's (guard.Guard), by the same
    rule. API clients (webuiapi, openai, curl) send no browser headers; the page's own requests are same-origin."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method", "GET").upper() not in SAFE_METHODS \
                and scope.get("path", "").startswith(PROTOCOL_PREFIXES):
            path = scope["path"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
            if (reason := cross_site_refusal(scope["method"], headers)) is not None:
                LOG.info(f"[app] request refused: {scope['method']} {path}: {reason}")
                err = ApiError(403, reason)
                response = a1111.a1111_error(err) if path.startswith(("/sdapi/", CONTROLNET)) \
                    else openai_images.openai_error(err)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class McpArguments:
    """ASGI middleware: an MCP ``tools/call`` whose arguments hold a number JSON cannot give as a finite
    float (``1e400``, ``NaN``, ``Infinity``) is answered with a tool error naming the argument and the
    number as sent. The mcp SDK would turn it into null on its way to the tool's schema check
    (mcp_server.arguments_refusal: "seed: None is not of type 'integer'"). Anything else passes on with its body
    unchanged."""

    MAX_BODY = 1_000_000  # bytes read to check; a larger body passes on as it is (the server's guard caps it)

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith(MCP_PATH):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more and size <= self.MAX_BODY:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(chunks, message, receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        if not more and (answer := nonfinite_call(b"".join(chunks))) is not None:
            response = JSONResponse(answer)
            return await response(scope, receive, send)
        return await self.app(scope, _replay(chunks, None, receive, more), send)


def _replay(chunks: list[bytes], pending, receive, more: bool = False):
    """A ``receive`` that gives the body read so far (then ``pending``, a message read past it), then reads on."""
    queue = [{"type": "http.request", "body": b"".join(chunks), "more_body": more}] if chunks else []
    if pending is not None:
        queue.append(pending)

    async def replayed():
        return queue.pop(0) if queue else await receive()

    return replayed


# The /generate tool's arguments that are numbers (its other arguments are text).
NUMBER_ARGUMENTS = ("seed", "guidance_scale", "num_inference_steps", "width", "height",  # the tools' number inputs
                    "strength", "refiner_switch_at", "upscale")


def nonfinite_call(body: bytes) -> dict | None:
    """The JSON-RPC answer (a tool error, as the mcp SDK gives for a bad argument) to an MCP ``tools/call``
    ``body`` whose arguments hold a non-finite number, naming it (``seed: 1e400 is not a finite
    number...``), or null for one of :data:`NUMBER_ARGUMENTS`; None for any other body."""
    bad = []

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            bad.append(text)
        return value

    try:
        message = json.loads(body, parse_float=number, parse_constant=number)
    except (ValueError, RecursionError):
        return None
    params = message.get("params") if isinstance(message, dict) else None
    if message.get("method") != "tools/call" if isinstance(message, dict) else True:
        return None
    if not isinstance(params, dict) or not isinstance(params.get("arguments"), dict):
        return None
    # A client's JSON encoder may send a number it cannot carry (1e400, infinity) as null, as the Python mcp SDK
    # does: where the tool takes a number, null is named too, rather than left to "None is not of type 'integer'".
    nulls = [name for name in NUMBER_ARGUMENTS if name in params["arguments"] and params["arguments"][name] is None]
    if not bad and not nulls:
        return None
    if bad:
        names = [name for name, value in params["arguments"].items()
                 if isinstance(value, float) and not math.isfinite(value)]
        field = names[0] if names else "arguments"  # the tool's arguments are flat: a nested one is named whole
        text = (f"{field}: {bad[0][:40]} is not a finite number (beyond what JSON numbers can carry here); "
                "send a number within the argument's range")
    else:
        text = (f"{nulls[0]}: got null where a number belongs (a client sends a number JSON cannot carry, such as "
                "1e400 or infinity, as null); send a number within the argument's range")
    LOG.info(f"[app] request refused: MCP {params.get('name')}: {text}")
    return {"jsonrpc": "2.0", "id": message.get("id"),
            "result": {"content": [{"type": "text", "text": text}], "isError": True}}


def _off_router(reason: str) -> APIRouter:
    off = APIRouter()

    @off.api_route(a1111.PREFIX + "/{rest:path}", methods=["GET", "POST"])
    async def a1111_off(rest: str):
        return a1111.a1111_error(ApiError(403, f"the AUTOMATIC1111 API is off: {reason}"))

    @off.api_route(openai_images.PREFIX + "/{rest:path}", methods=["GET", "POST"])
    async def openai_off(rest: str):
        return openai_images.openai_error(ApiError(403, f"the OpenAI Images API is off: {reason}"))

    return off
