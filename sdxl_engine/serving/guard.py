"""The HTTP guard of the served app: an ASGI layer outside Gradio's own, in place before the server listens
(server.before_listening).

:class:`Guard` lets through only the calls, result streams and files :class:`Routes` allows (the /generate
API, the page's own events as the page calls them, the files the app created), lets only the page's image
uploads through (:data:`UPLOAD_PATH`: images only, never served back), refuses request bodies over 1 MB (48 MB
on the routes that take images, :data:`IMAGE_BODY_PATHS` and the uploads, and for calls of :data:`IMAGE_TOOL`),
never lets ``Access-Control-Allow-Origin`` name a foreign origin, refuses a state-changing request another site's
page sent (:func:`cross_site_refusal`, the rule of every route: a 403 here for Gradio's routes and MCP, in the
protocols' shapes for ``/sdapi`` and ``/v1``, apis.CrossSiteGuard), adds ``Retry-After`` to "queue full" answers,
answers a raw API call with too few values with a 422 naming the inputs (and fills in the inputs added to an
endpoint later, apis/tools.optional_inputs, that a raw call leaves out) and stamps each request's arrival
(:func:`arrival_time`). A cancel goes to Gradio as it came: Gradio cancels the event's task, which stops its job in
the service (handler.follow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from urllib.parse import urlsplit

from sdxl_engine.engine.contract import clock
from sdxl_engine.service.service import SHUTTING_DOWN  # the service's own text: one for every /generate client
from sdxl_engine.serving import gradio_internals

LOG = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_BODY_BYTES = 1_000_000  # JSON of a /generate call is < 100 kB even with a 20 000-character prompt
# The routes that take images (an init image and a mask, each at most uploads.MAX_IMAGE_BYTES once decoded,
# 4/3 of that as base64) and their body caps; every other path keeps MAX_BODY_BYTES.
MAX_IMAGE_BYTES = 16 * 1024 * 1024  # one image file a client sends: a 2048 x 2048 RGB PNG of noise is 12.6 MB
MAX_IMAGE_BODY_BYTES = 48_000_000
IMAGE_BODY_PATHS = ("/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/v1/images/edits", "/v1/jobs",  # txt2img: ControlNet's
                    "/controlnet/detect")
# The API endpoint whose calls carry an image as base64 text (apis/mcp_image.py): its calls, and only they, may be
# larger than MAX_BODY_BYTES on the routes that reach it (a raw call by name, queue/join, the MCP server).
IMAGE_TOOL = "image_to_image"
# The endpoints whose calls may carry an image as base64 text over MAX_BODY_BYTES: the image tool, and /generate
# with a ControlNet's control_image (apis/tools.py CONTROL_INPUTS).
IMAGE_TEXT_CALLS = (IMAGE_TOOL, "generate")
MCP_PATH = "/gradio_api/mcp"
CONTROLNET = "/controlnet/"  # sd-webui-controlnet's routes (apis/controlnet.py), A1111's error shape
BLOCKED_PATH_PREFIXES = gradio_internals.UPLOAD_ROUTES  # Gradio's upload routes: all but UPLOAD_PATH refused
# The one upload route the page uses (its image editor, in "Image to image"): POST only, with a demo's Routes,
# a body of at most MAX_IMAGE_BODY_BYTES (the editor sends picture, brush layer and composite at once: three
# 2048 x 2048 PNGs fit), at most MAX_UPLOAD_FILES files, each a PNG, JPEG or WebP by its first bytes (else the
# files are deleted and the answer is 415). Uploads are never served back (app_files) and the image event
# deletes them when it ends (handler.discard_uploads).
UPLOAD_PATH = gradio_internals.UPLOAD_PATH
MAX_UPLOAD_FILES = 8
IMAGE_EVENT = "img2img"  # the page's image to image event (private): the one whose call may name uploaded files
CONTROL_EVENT = "control_upload"  # the page's ControlNet picture upload (private): may name uploaded files too
IP_EVENT = "ip_upload"  # the page's IP-Adapter reference picture upload (private): likewise
PICTURE_EVENTS = (CONTROL_EVENT, IP_EVENT)  # the one-file picture uploads (page_image.picture_function)
NOT_AN_IMAGE = "uploads take PNG, JPEG or WebP images only"
UNUSED_ROUTES = gradio_internals.UNUSED_ROUTES  # Gradio routes this page never uses, refused (404, one line)
RETRY_AFTER_S = 5
ARRIVED_HEADER = b"x-sdxl-arrived"  # set by Guard on every request: contract.clock() at arrival


def _host_of(origin: str) -> str:
    try:
        return (urlsplit(origin).hostname or "").lower()
    except ValueError:
        return ""


# --- requests from another site's page -------------------------------------------------------------------------

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CROSS_SITE = "requests from another site's page are refused"
# The routes that answer a cross-site request in their own protocol's error shape (apis.CrossSiteGuard applies
# cross_site_refusal there); the Guard applies it to every other path: Gradio's calls, queue, uploads, cancels, MCP.
PROTOCOL_PREFIXES = ("/sdapi/", "/v1/", "/internal/", "/controlnet/")
DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (a browser's Origin header: ``scheme://host[:port]``) names the server that ``host`` (the
    request's Host header) names: the same host name and port, a port left out being the origin scheme's default
    (a page at ``https://name`` posts ``Origin: https://name`` with ``Host: name``). ``null`` and anything else that
    is not an http(s) origin is not."""
    try:
        sent, here = urlsplit(origin), urlsplit("//" + host)
        sent_port, here_port = sent.port, here.port  # a port that is not a number raises
    except ValueError:
        return False
    if sent.scheme not in DEFAULT_PORTS or not sent.hostname or not here.hostname:
        return False
    default = DEFAULT_PORTS[sent.scheme]
    return (sent.hostname, sent_port or default) == (here.hostname, here_port or default)


def cross_site_refusal(method: str, headers) -> str | None:
    """Why a request with ``method`` and ``headers`` (a mapping, lower-case names) looks sent by another site's
    page, or None. The one rule of every route that changes state (the Guard's for Gradio's routes and MCP,
    apis.CrossSiteGuard's for ``/sdapi`` and ``/v1``).

    Only state-changing methods are checked: a form another site posts needs no CORS preflight, so without this
    any page a user visits could start, interrupt or cancel their requests. Browsers send ``Sec-Fetch-Site`` with
    every request (``cross-site``, ``same-site``, ``same-origin``, ``none`` for one the user typed) and ``Origin``
    with every POST, and a page can set neither; API clients (gradio_client, curl, webuiapi, openai, MCP SDKs)
    send neither (or their own Origin, refused unless it is this server). Refused: ``Sec-Fetch-Site`` cross-site
    or same-site; else an ``Origin`` that is not this server's ``Host`` (:func:`same_origin`; ``null`` included),
    unless the browser says ``Sec-Fetch-Site: same-origin``: then the page is this server's own even where a
    reverse proxy rewrote ``Host``.
    """
    if method.upper() in SAFE_METHODS:
        return None
    site = (headers.get("sec-fetch-site") or "").lower()
    if site in ("cross-site", "same-site"):
        return f"{CROSS_SITE} (Sec-Fetch-Site: {site})"
    origin = (headers.get("origin") or "").strip()
    if origin and site != "same-origin" and not same_origin(origin, headers.get("host") or ""):
        return f"{CROSS_SITE} (Origin: {origin} is not this server)"
    return None




NOT_JSON = "the request body is not a JSON object"
NESTED = "nested too deeply"  # deeper than Python's parser recurses (a RecursionError, not a JSONDecodeError)
NOT_VALID_JSON = "the request body is not valid JSON"


def mcp_parse_error(reason: str) -> dict:
    """The MCP server's answer (HTTP 400) to a body it cannot parse (``mcp.server.streamable_http``: JSON-RPC's
    parse error, -32700, with the id "server-error")."""
    return {"jsonrpc": "2.0", "id": "server-error", "error": {"code": -32700, "message": f"Parse error: {reason}"}}


@dataclasses.dataclass(frozen=True)
class Unparsed:
    """A body :func:`parsed` could not read as JSON, with the parser's reason (for the refusal's message)."""

    reason: str


def parsed(body: bytes | None):
    """``body``'s JSON value; None for an empty body, :class:`Unparsed` for one that is not valid JSON (every check
    wants a JSON object and refuses anything else; the refusal says which). The guard parses a call's body once
    here and every check takes the value (an image call's body may be 48 MB)."""
    try:
        return json.loads(body or b"null")
    except RecursionError:
        return Unparsed(NESTED)
    except ValueError as err:  # JSONDecodeError, or bytes that are no UTF-8 text
        return Unparsed(str(err)[:120])


class Routes:
    """What the guard lets through to Gradio's call and file routes, read from the demo at each request.

    Gradio 6 answers ``/gradio_api/call|run|api/<name>`` for every event with a server function,
    whatever its ``api_visibility``, and serves through ``/gradio_api/file=`` any file under its
    temp folder. Here:

    - calls by name: only the public API endpoints (``/generate``, ``/image_to_image``);
    - calls by ``fn_index`` (how the page calls its events: ``queue/join`` for queued ones,
      ``run/predict`` with a session for the others): only events with a server function, each
      through the route the page uses for it;
    - result streams (``call/<name>/<event id>``, ``queue/data``): only ones the queue knows;
    - files: only those this app created and Gradio recorded (``demo.temp_file_sets``: each
      request's PNGs; ``keep_in_cache``); no ``proxy=`` and no URL fetched on a client's behalf.

    Other paths pass: the page, Gradio's config and assets, and the protocol APIs (serving/apis:
    ``/sdapi/v1/...``, ``/v1/...`` and Gradio's MCP server at ``/gradio_api/mcp/``), which check
    their own inputs and key and run ``/generate`` only through the queue; every body is still capped.

    :meth:`refusal` says why a request is refused (the guard answers 404 with one log line).
    """

    def __init__(self, demo):
        self.demo = demo
        fns = gradio_internals.event_fns(demo)
        self.api_names = frozenset(fn.api_name for fn in fns if fn.public)
        self.queued = frozenset(fn.fn_index for fn in fns if fn.queued)
        self.direct = frozenset(fn.fn_index for fn in fns if not fn.queued)

    def api_list(self) -> str:
        """``this app's API: /generate, /image_to_image``: the public endpoints, for a refusal's message."""
        return "this app's API: " + ", ".join(f"/{name}" for name in sorted(self.api_names))

    def served_files(self) -> set[str]:
        """Absolute paths of the files this app created in Gradio's temp folder (those it serves: app_files;
        never an upload)."""
        return app_files(self.demo)

    def _event_known(self, event_id: str) -> bool:
        """Whether ``event_id``'s result is still to be read (gradio_internals.event_pending). A result
        already read is not: its session's stream stays open, so Gradio would send heartbeats for ever."""
        return gradio_internals.event_pending(self.demo, event_id)

    def refusal(self, method: str, path: str, query: str, payload=None) -> str | None:
        """Why the request is refused, or None to let it through. ``payload``: a POST's body as :func:`parsed`
        gives it (else None)."""
        if (match := gradio_internals.FILE_ROUTE.match(path)) is not None:
            wanted = match["path"]
            if match["kind"] == "proxy=" or method not in ("GET", "HEAD") or "://" in wanted \
                    or os.path.abspath(wanted) not in self.served_files():
                return "not a file of this app"
            return None
        if method == "GET" and (match := gradio_internals.RESULT_STREAM.match(path)) is not None:
            if match["name"] not in self.api_names:
                return f"no API endpoint /{match['name']} ({self.api_list()})"
            if not self._event_known(match["event"]):
                return "no such event (unknown, or its result was already read)"
            return None
        if method == "GET" and gradio_internals.QUEUE_DATA.match(path):
            session = gradio_internals.stream_session(query)
            return None if gradio_internals.session_stream_known(self.demo, session) else "no such session"
        join, call = gradio_internals.QUEUE_JOIN.match(path), gradio_internals.DIRECT_CALL.match(path)
        if method != "POST" or not (join or call):
            return None
        if isinstance(payload, Unparsed):
            return f"{NOT_VALID_JSON} ({payload.reason})"
        if not isinstance(payload, dict):
            return NOT_JSON
        fn_index, session = gradio_internals.join_fields(payload)
        if _holds_file(payload.get("data")) and not (join and self._image_files_ok(fn_index, payload.get("data"))):
            return "this app takes no files"  # Gradio would fetch or copy it into its temp folder
        if join and type(fn_index) is int and gradio_internals.api_name_of(self.demo, fn_index) in PICTURE_EVENTS:
            data = payload.get("data")  # the page's file box sends its one file (Gradio's check of it logs a traceback)
            if not (isinstance(data, list) and len(data) == 1 and gradio_internals.is_file_data(data[0])):
                return "the picture's upload takes one uploaded file"
        if join:  # the page's queued events, and gradio_client's /generate
            return None if type(fn_index) is int and fn_index in self.queued else "no such queued event"
        name = call["name"]
        if name in self.api_names:  # by name; a fn_index in the body would pick another event
            return None if fn_index is None or gradio_internals.api_name_of(self.demo, fn_index) == name \
                else "fn_index does not name this endpoint"
        if name == "predict" and path.startswith(("/gradio_api/run/", "/run/")) and type(fn_index) is int \
                and fn_index in self.direct and isinstance(session, str) and session:
            return None  # the page's events that skip the queue
        return f"no API endpoint /{name} ({self.api_list()})"

    def _image_files_ok(self, fn_index, data) -> bool:
        """Whether ``data`` may name files: only in a call of the image event (IMAGE_EVENT) or of a picture's
        upload (PICTURE_EVENTS: the ControlNet's, the IP-Adapter's), and only files Gradio's upload route wrote or
        the app created (a gallery PNG sent to the editor)."""
        if type(fn_index) is not int or gradio_internals.api_name_of(self.demo, fn_index) not in (IMAGE_EVENT,
                                                                                               *PICTURE_EVENTS):
            return False
        paths = _file_paths(data)
        if paths is None:
            return False
        allowed = app_files(self.demo) | {os.path.abspath(str(f)) for f in
                                          list(gradio_internals.upload_files(self.demo))}
        return all("://" not in p and os.path.abspath(p) in allowed for p in paths)

    @staticmethod
    def cleaned(payload):
        """A call's payload (already let through) with its ``event_data`` cut to what the page's
        select handlers read: the index (and whether it is selected), as a new dict; ``payload`` itself
        when it has none. The rest (the selected gallery item, a file object) is the client's and
        Gradio would check or fetch it."""
        event = payload.get("event_data") if isinstance(payload, dict) else None
        if not isinstance(event, dict):
            return payload
        index = event.get("index")
        valid = type(index) is int or isinstance(index, list) and all(type(i) is int for i in index)
        return {**payload, "event_data": {"index": index if valid else None, "value": None,
                                          "selected": event.get("selected") is not False}}


def app_files(demo) -> set[str]:
    """Absolute paths of the files this app created in Gradio's temp folder (each request's PNGs, kept files):
    every file Gradio recorded except uploads (gradio_internals.upload_files), which a client sent. Gradio also
    records an upload in the set of the component it was given to; it stays an upload."""
    files = set(gradio_internals.kept_files(demo))
    for file_set in gradio_internals.file_sets(demo):
        files.update(list(file_set))
    return {os.path.abspath(str(f)) for f in files} - {os.path.abspath(str(f)) for f in
                                                       list(gradio_internals.upload_files(demo))}


def image_kind(head: bytes) -> str | None:
    """"PNG", "JPEG" or "WEBP" when ``head`` (a file's first 12 bytes or more) starts as that format does; else
    None. Only a first look: apis.uploads.open_image decodes (and bounds) the file when it is used."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def upload_refusal(demo, paths) -> str | None:
    """Why the files Gradio's upload route just wrote (``paths``, its JSON answer) are refused, or None: more
    than MAX_UPLOAD_FILES, a path that is not an upload, a file that is not a PNG, JPEG or WebP image."""
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return "the upload route gave no list of files"
    if len(paths) > MAX_UPLOAD_FILES:
        return f"at most {MAX_UPLOAD_FILES} files per upload"
    uploads = {os.path.abspath(str(f)) for f in list(gradio_internals.upload_files(demo))}
    for path in paths:
        if os.path.abspath(path) not in uploads:
            return "not an upload"
        try:
            with open(path, "rb") as handle:
                head = handle.read(16)
        except OSError:
            return "the upload was not written"
        if image_kind(head) is None:
            return f"{NOT_AN_IMAGE} (a file starting {head[:8]!r} is none of them)"
    return None


class UploadFiles:
    """When an upload may be deleted. Gradio's upload route names a file by its content (``<temp>/<sha of the
    bytes>/<file name>``), so the image editor's uploads of an unchanged picture (it sends its background, layer
    and composite with every value, and again and again while a stroke is drawn) all land on one path. Deleting
    that path for one request (handler.discard_uploads at its end) took the file from an upload of the same bytes
    being checked (a 415 "the upload was not written" for the editor's own upload), removed the folder Gradio was
    about to write into, and took the picture of a queued request naming the same path.

    So the guard counts the uploads being written (:meth:`writing`) and notes when each path was last uploaded
    (:meth:`uploaded`), and every delete of an upload (:meth:`remove`: the image event's end, a refused upload, the
    janitor) happens under one lock with them: none while another upload is being written, none of a path
    uploaded again since the one deleting it began. What is kept goes with the janitor (it deletes uploads no
    request took after ``temp_keep_s``). Thread-safe: the guard runs on the event loop, requests and the janitor
    on their own threads; the lock is never held across an ``await``."""

    def __init__(self, limit: int = 65536):
        self.limit = limit
        self._lock = threading.Lock()
        self._writing = 0
        self._last: OrderedDict[str, float] = OrderedDict()  # absolute path -> clock() of its last upload, oldest first

    @contextlib.contextmanager
    def writing(self):
        """Count one upload as being written while the block runs (Gradio parses it and writes its files)."""
        with self._lock:
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1

    def uploaded(self, paths, now: float | None = None) -> None:
        """Note that ``paths`` were uploaded (let through) at ``now`` (contract.clock(); default: now). Call it inside
        :meth:`writing`, so no delete runs between the write and the note."""
        now = clock() if now is None else now
        with self._lock:
            for path in paths:
                self._last[os.path.abspath(path)] = now
                self._last.move_to_end(os.path.abspath(path))
            while len(self._last) > self.limit:
                self._last.popitem(last=False)

    def remove(self, paths, since: float, writers: int = 0) -> list[str]:
        """Delete each of ``paths`` (files Gradio's upload route wrote) and its folder when left empty, unless it may
        still be used: while uploads other than the caller's own ``writers`` are being written, or when it was
        uploaded at or after ``since`` (contract.clock(): when the caller's request arrived or its upload began).
        Returns the paths deleted (or already gone); the others are left to the janitor."""
        deleted = []
        with self._lock:
            if self._writing > writers:
                return deleted
            for path in {os.path.abspath(p) for p in paths}:
                if self._last.get(path, float("-inf")) >= since:
                    continue
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    LOG.warning(f"[app] warning: could not delete an upload: {err}")
                    continue
                deleted.append(path)
                self._last.pop(path, None)
                try:
                    os.rmdir(os.path.dirname(path))  # Gradio's per-content folder; left when another file is in it
                except OSError:
                    pass
        return deleted


UPLOADS = UploadFiles()  # the served process's uploads (Guard, handler.discard_uploads, janitor.TempJanitor)


def remove_uploads(demo, paths, since: float) -> None:
    """Delete the files a refused upload (``paths``, Gradio's answer, its writing begun at ``since``) made; they
    stay in Gradio's upload set, so their paths are never served (app_files). Called inside the upload's own
    :meth:`UploadFiles.writing`: a concurrent upload of the same bytes keeps them (the janitor takes them)."""
    uploads = {os.path.abspath(str(f)) for f in list(gradio_internals.upload_files(demo))}
    UPLOADS.remove([p for p in paths if isinstance(p, str) and os.path.abspath(p) in uploads]
                   if isinstance(paths, list) else [], since, writers=1)


def _file_paths(value, depth: int = 0) -> list | None:
    """The ``path`` of every dict in ``value`` (JSON) that Gradio takes for a file; None when it is deeper than
    any value the page sends or a file's path is not a string."""
    if depth > 32:
        return None
    found: list = []
    if isinstance(value, dict):
        if "path" in value:
            if not isinstance(value["path"], str):
                return None
            found.append(value["path"])
        items = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return found
    for item in items:
        inner = _file_paths(item, depth + 1)
        if inner is None:
            return None
        found += inner
    return found


def _holds_file(value, depth: int = 0) -> bool:
    """Whether ``value`` (JSON) holds what Gradio takes for a file: a dict with a string ``path``."""
    if depth > 32:
        return True  # deeper than any value the page sends
    if isinstance(value, dict):
        return isinstance(value.get("path"), str) or any(_holds_file(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_holds_file(v, depth + 1) for v in value)
    return False


# Raw calls whose JSON body carries an endpoint's input values: /gradio_api/{call,run,api}/<api_name>
# ("data": the values in order) and /gradio_api/queue/join ("fn_index" names the event).


def api_inputs(demo, optional_inputs: dict[str, tuple[str, ...]]
               ) -> tuple[dict[str, tuple[str, ...]], dict[int, str], dict[str, tuple]]:
    """({api_name: input names}, {fn_index: api_name}, {api_name: defaults of its ``optional_inputs``, in
    order}) of ``demo``'s named API endpoints. ``optional_inputs``: {api_name: the inputs it gained after its first
    release, at its end} (apis/tools.optional_inputs: only optional inputs are ever added, at the end), which a raw
    call may leave out and then gets the same defaults gradio_client fills in (:func:`completed`). The defaults
    are the API description's (``parameter_default``: the component's value, what gradio_client sends for a
    parameter it is not given)."""
    endpoints = gradio_internals.api_endpoints(demo)
    inputs = {name: tuple(param for param, _ in params) for name, params in endpoints.items()}
    defaults = {}
    for name, params in endpoints.items():
        optional = optional_inputs.get(name, ())
        if optional and tuple(param for param, _ in params[-len(optional):]) == optional:
            defaults[name] = tuple(default for _, default in params[-len(optional):])
    fns = {fn_index: gradio_internals.api_name_of(demo, fn_index)
           for fn_index in gradio_internals.fn_indices(demo, inputs)}
    return inputs, fns, defaults


def raw_call(path: str, payload, fns: dict[int, str]) -> tuple[str, dict] | None:
    """(api_name, payload) of a raw call (``/call/<name>``, ``/run/<name>``) or queue join (``fn_index``)
    whose ``payload`` (the body, :func:`parsed`) is a JSON object with a ``data`` list, else None
    (:func:`arity_error` and :func:`completed` take it)."""
    call, join = gradio_internals.API_CALL.match(path), gradio_internals.QUEUE_JOIN.match(path)
    if not (call or join) or not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return None
    return (call["name"] if call else fns.get(gradio_internals.join_fields(payload)[0])), payload


def arity_error(found: tuple[str, dict] | None, inputs: dict[str, tuple[str, ...]],
                defaults: dict[str, tuple] | None = None) -> str | None:
    """The message for a raw call (``found``, from :func:`raw_call`) to a named endpoint with fewer values than it
    takes, else None.

    An endpoint's trailing optional inputs (their ``defaults``, from :func:`api_inputs`) may be left
    out: :func:`completed` fills them in. Extra values are left to Gradio (it ignores them); bodies that are
    not JSON with a ``data`` list are left to Gradio's own validation.
    """
    if found is None or (names := inputs.get(found[0])) is None:
        return None
    name, data = found[0], found[1]["data"]
    optional = len((defaults or {}).get(name, ()))
    needed = names[:len(names) - optional]
    if len(data) >= len(needed):
        return None
    later = f"; {', '.join(names[len(needed):])} may follow them" if optional else ""
    return (f"{name} takes {len(needed)} inputs ({', '.join(needed)}); got {len(data)}. "
            f"Send every value in this order{later} (gradio_client fills in the optional ones).")


def completed(found: tuple[str, dict] | None, inputs: dict[str, tuple[str, ...]],
              defaults: dict[str, tuple]) -> dict | None:
    """The payload of raw call ``found`` (from :func:`raw_call`) with the trailing optional inputs it left out
    (:func:`api_inputs`' optional inputs) set to their ``defaults``, so the call runs as gradio_client's does; None when
    nothing is to be filled in."""
    if found is None or found[0] not in defaults or (names := inputs.get(found[0])) is None:
        return None
    name, payload = found
    missing = len(names) - len(payload["data"])
    if not 0 < missing <= len(defaults[name]):
        return None
    return {**payload, "data": [*payload["data"], *defaults[name][len(defaults[name]) - missing:]]}


def _with_length(scope: dict, body: bytes) -> dict:
    """``scope`` with its Content-Length header set to ``body``'s length (a body the guard rewrote)."""
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            + [(b"content-length", str(len(body)).encode())]}


class Guard:
    """ASGI middleware, outermost: see the module docstring for what it refuses or rewrites.

    ``inputs``/``fns``/``defaults`` (from :func:`api_inputs`) name the API endpoints whose raw calls are
    checked for missing values (:func:`arity_error`) and completed with their optional ones (:func:`completed`).
    ``routes`` (a :class:`Routes`) decides which calls, result streams and files reach Gradio at all; a refused
    request gets a 404 and one log line.
    """

    def __init__(self, app, gate: RequestGate | None = None, max_body: int = MAX_BODY_BYTES,
                 inputs: dict | None = None, fns: dict | None = None, routes: Routes | None = None,
                 log=LOG.info, defaults: dict | None = None):
        self.app = app
        self.gate = gate
        self.max_body = max_body
        self.inputs = inputs or {}
        self.fns = fns or {}
        self.defaults = defaults or {}
        self.routes = routes
        self.log = log

    async def _refuse(self, send, method: str, path: str, reason: str, status: int = 0, answer: dict | None = None
                      ) -> None:
        """Answer ``status`` (default: 422 for a body that is not JSON, else 404) with ``reason`` (or ``answer``, a
        protocol's own error body); one log line."""
        self.log(f"[app] refused {method} {path[:160]!r}: {reason}")
        body = json.dumps(answer or {"error": reason, "detail": reason}).encode()
        malformed = reason == NOT_JSON or reason.startswith(NOT_VALID_JSON)
        await _plain(send, status or (422 if malformed else 404), body, content_type=b"application/json")

    def body_limit(self, path: str) -> int:
        """The body cap for ``path``: :data:`MAX_IMAGE_BODY_BYTES` on a route that takes images (the image APIs, the
        page's upload route) or may carry an
        :data:`IMAGE_TOOL` call (or this guard's own cap if larger; :meth:`over_cap_refused` then checks that a
        body over ``max_body`` is one), else this guard's (``max_body``)."""
        call = gradio_internals.DIRECT_CALL.match(path)
        if path in IMAGE_BODY_PATHS or path == UPLOAD_PATH or gradio_internals.QUEUE_JOIN.match(path) \
                or path.rstrip("/") == MCP_PATH or (call is not None and call["name"] in IMAGE_TEXT_CALLS):
            return max(self.max_body, MAX_IMAGE_BODY_BYTES)
        return self.max_body

    def over_cap_refused(self, path: str, size: int, payload) -> bool:
        """Whether a body of ``size`` bytes, read whole on ``path`` (``payload``: its value, :func:`parsed`), is
        over ``max_body`` without being an :data:`IMAGE_TOOL` call: a queue/join of another event, an MCP message
        other than a ``tools/call`` of the tool."""
        if size <= self.max_body or path in IMAGE_BODY_PATHS or path == UPLOAD_PATH:
            return False
        if (call := gradio_internals.DIRECT_CALL.match(path)) is not None:
            return call["name"] not in IMAGE_TEXT_CALLS
        if not isinstance(payload, dict):
            return True
        if gradio_internals.QUEUE_JOIN.match(path):
            return self.fns.get(gradio_internals.join_fields(payload)[0]) not in IMAGE_TEXT_CALLS
        params = payload.get("params")
        return not (payload.get("method") == "tools/call" and isinstance(params, dict)
                    and params.get("name") in IMAGE_TEXT_CALLS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.gate is not None:
            self.gate.touch()
        if scope["method"] not in SAFE_METHODS and not path.startswith(PROTOCOL_PREFIXES):
            # Before anything reads the body or reaches Gradio: /gradio_api/call/generate took a foreign Origin
            # (200, queued) while the protocol routes refused it (issue #47).
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
            if (reason := cross_site_refusal(scope["method"], headers)) is not None:
                return await self._refuse(send, scope["method"], path, reason, 403)
        upload = path == UPLOAD_PATH and scope["method"] == "POST" and self.routes is not None
        if path.startswith(BLOCKED_PATH_PREFIXES) and not upload:
            return await _plain(send, 404, b"uploads are off: this app takes image uploads only, from its page")
        if path.startswith(UNUSED_ROUTES):
            return await self._refuse(send, scope["method"], path, "not an endpoint of this app")
        if self.gate is not None and self.gate.closed and scope["method"] == "POST" and _starts_work(path):
            # Raw calls only: a queue/join goes on to its event, whose submit the service refuses (a gr.Error the
            # page and gradio_client show; a 503 here would read "busy" / "Queue is full" there).
            return await _plain(send, 503, SHUTTING_DOWN.encode(), [(b"retry-after", b"60")])
        # When the request arrived (a client's own header of that name is dropped): the queue wait starts here.
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or [] if k.lower() != ARRIVED_HEADER]
                 + [(ARRIVED_HEADER, repr(clock()).encode())]}
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        limit = self.body_limit(path)
        if not length.isdigit() or int(length) > limit:
            return await _too_large(send, path, limit)
        origin = headers.get(b"origin", b"").decode("latin-1")
        foreign = bool(origin) and _host_of(origin) not in LOOPBACK_NAMES
        seen = 0
        started = False

        async def limited_receive():  # bodies sent without Content-Length (chunked) are counted too
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if seen > limit and not started:  # the app answers a body it never got whole: 413 instead
                return
            if message["type"] == "http.response.start":
                started = True
                out = [(k, v) for k, v in message.get("headers", [])
                       if not (foreign and k.lower().startswith(b"access-control-allow-"))]
                if message["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in out):
                    out.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": out}
            await send(message)

        inner_receive = limited_receive
        method, query = scope["method"], scope.get("query_string", b"").decode("latin-1")
        if self.routes is not None and method != "POST" \
                and (reason := self.routes.refusal(method, path, query, None)) is not None:
            return await self._refuse(send, method, path, reason)
        if method == "POST" and (self.inputs or self.routes or limit > self.max_body) \
                and (gradio_internals.DIRECT_CALL.match(path) or gradio_internals.QUEUE_JOIN.match(path)):
            body = await _read_body(limited_receive)
            if body is None:  # over the cap, or the client left
                return await _too_large(send, path, limit) if seen > limit else None
            payload = parsed(body)  # once: each check below takes the value
            if self.over_cap_refused(path, len(body), payload):
                return await _too_large(send, path, self.max_body)
            sent = payload
            if self.routes is not None:
                if (reason := self.routes.refusal(method, path, query, payload)) is not None:
                    return await self._refuse(send, method, path, reason)
                payload = self.routes.cleaned(payload)
            found = raw_call(path, payload, self.fns) if self.inputs else None
            message = arity_error(found, self.inputs, self.defaults)
            if message is not None:
                return await _plain(send, 422, json.dumps({"error": message, "detail": message}).encode(),
                                    content_type=b"application/json")
            if (whole := completed(found, self.inputs, self.defaults)) is not None:
                payload = whole
            if payload is not sent:  # rewritten: Gradio reads the new body (encoded once)
                body = json.dumps(payload).encode()
                scope = _with_length(scope, body)
            inner_receive = _replay(body, receive)
        elif upload:
            return await self._upload(scope, limited_receive, receive, guarded_send, send, lambda: seen > limit, path,
                                      limit)
        elif method == "POST" and path.rstrip("/") == MCP_PATH and limit > self.max_body:
            body = await _read_body(limited_receive)  # only a tools/call of the image tool may be large
            if body is None:
                return await _too_large(send, path, limit) if seen > limit else None
            payload = parsed(body)
            if isinstance(payload, Unparsed) and payload.reason == NESTED:
                # the MCP server's own parser would raise RecursionError (a 500 and a traceback): its answer to a
                # body that is no JSON instead
                return await self._refuse(send, method, path, f"{NOT_VALID_JSON} ({NESTED})", 400,
                                          mcp_parse_error(NESTED))
            if len(body) > self.max_body and self.over_cap_refused(path, len(body), payload):
                return await _too_large(send, path, self.max_body)
            inner_receive = _replay(body, receive)
        try:
            await self.app(scope, inner_receive, guarded_send)
        except Exception:
            if seen <= limit or started:
                raise
        if seen > limit and not started:  # a chunked body crossed the cap: the app saw a disconnect
            await _too_large(send, path, limit)


    async def _upload(self, scope, limited_receive, receive, guarded_send, send, over, path: str, limit: int) -> None:
        """Gradio's upload route, its answer held back until the files it wrote are checked (upload_refusal):
        passed on as it is, or the files deleted and a 415 (a 413 for a body over ``limit``).

        The body is read whole first (at most ``limit``): a client that leaves mid-upload is one log line, and
        Gradio, which would raise ClientDisconnect (a traceback) and leave its half-written temp file, never sees
        it. Gradio then writes and the files are checked inside UPLOADS.writing(), so no delete of an upload
        (another request's end, the janitor) takes a file between its write and its check."""
        body = await _read_body(limited_receive)
        if body is None:  # over the cap (a chunked body: limited_receive ends it there), or the client left
            if over():
                return await _too_large(send, path, limit)
            self.log(f"[app] upload cancelled: the client left before its body arrived ({path})")
            return None
        held: list = []

        async def hold(message):
            held.append(message)

        began = clock()
        with UPLOADS.writing():
            await self.app(scope, _replay(body, receive), hold)
            answer = b"".join(m.get("body", b"") for m in held if m["type"] == "http.response.body")
            start = next((m for m in held if m["type"] == "http.response.start"), None)
            try:
                paths = json.loads(answer) if start is not None and start["status"] == 200 else None
            except ValueError:
                paths = None
            reason = None if paths is None else upload_refusal(self.routes.demo, paths)
            if reason is not None:
                remove_uploads(self.routes.demo, paths, began)
            elif paths is not None:
                UPLOADS.uploaded(paths)
        if reason is not None:
            self.log(f"[app] refused POST {path!r}: {reason}"[:300])
            # Plain text, as this route's 413: the page shows an upload's refusal as "HTTP 415: <body>" (Gradio's
            # upload_files), so the body is the sentence a user reads; the file's first bytes are the log's only.
            shown = NOT_AN_IMAGE if reason.startswith(NOT_AN_IMAGE) else reason
            return await _plain(send, 415, shown.encode())
        for message in held:  # Gradio's answer: the paths, or its own refusal (not multipart, a file too large)
            await guarded_send(message)


async def _read_body(receive) -> bytes | None:
    """The whole request body from ``receive``, or None if it ends in a disconnect."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` once, then defers to ``receive`` (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def arrival_time(request) -> float | None:
    """contract.clock() when ``request`` (a gr.Request) reached the server, stamped by Guard; None if unknown.

    On the engines' clock already: pass it on as ``generate(..., arrived=...)`` as it is."""
    try:
        return float(request.headers[ARRIVED_HEADER.decode()])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _starts_work(path: str) -> bool:
    """Whether a POST to ``path`` is a raw call that would start work (call/<api>, run/<api>, api/<api>)."""
    return path.startswith(("/gradio_api/call/", "/gradio_api/run/", "/gradio_api/api/", "/call/", "/run/", "/api/"))


TOO_LARGE = "request body too large (limit 1 MB)"


def too_large_message(limit: int) -> str:
    """The 413's message for a body cap of ``limit`` bytes (1 MB: :data:`TOO_LARGE`)."""
    return f"request body too large (limit {limit / 1e6:g} MB)"


async def _too_large(send, path: str, limit: int = MAX_BODY_BYTES) -> None:
    """The 413 for an over-long body, in the shape of the protocol ``path`` belongs to: AUTOMATIC1111's
    error object under /sdapi/ (modules/api/api.py), OpenAI's under /v1/, plain text elsewhere."""
    message = too_large_message(limit)
    if path.startswith(("/sdapi/", "/controlnet/")):
        body = {"error": "HTTPException", "detail": message, "body": "", "errors": message}
    elif path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    else:
        return await _plain(send, 413, message.encode())
    await _plain(send, 413, json.dumps(body).encode(), content_type=b"application/json")


async def _plain(send, status: int, body: bytes, extra: list | None = None,
                 content_type: bytes = b"text/plain; charset=utf-8") -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


def install_guard(app, gate: RequestGate | None = None, demo=None,
                  optional_inputs: dict[str, tuple[str, ...]] | None = None) -> None:
    """Put :class:`Guard` outside every other middleware of Gradio's FastAPI ``app``.

    Gradio adds its CORS middleware inside ``launch``, so the guard goes in after it
    (gradio_internals.add_outermost_middleware). The security tests probe the result over HTTP. With ``demo``, raw
    calls of its API endpoints are checked for missing values, and only the calls, streams and
    files :class:`Routes` allows reach Gradio; ``optional_inputs``: the endpoints' later inputs (:func:`api_inputs`).
    """
    inputs, fns, defaults = api_inputs(demo, optional_inputs or {}) if demo is not None else ({}, {}, {})
    gradio_internals.add_outermost_middleware(app, Guard, gate=gate, inputs=inputs, fns=fns, defaults=defaults,
                                              routes=None if demo is None else Routes(demo))


class RequestGate:
    """The server's stop switch and clock for the guard: after :meth:`close` raw calls are refused (Guard; the
    service refuses every front's requests once closed with it, server.serve), and ``last_request`` is when the last
    HTTP request arrived (the shutdown waits for a quiet moment before it closes)."""

    def __init__(self):
        self.closed = False
        self.last_request = time.monotonic()  # when the last HTTP request arrived (set by Guard)

    def touch(self) -> None:
        """Record that an HTTP request arrived now."""
        self.last_request = time.monotonic()

    def close(self) -> None:
        self.closed = True
