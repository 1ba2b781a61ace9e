"""Every use serving makes of Gradio's internals, in one module, with the version it was checked against.

The HTTP guard (guard.Routes, guard.install_guard), the temp-folder janitor (janitor.TempJanitor),
and the clean stop (server.serve) need what Gradio does not document: its event table (``Blocks.fns``,
``BlockFunction._id``), its queue's tables (``Blocks._queue``: ``event_ids_to_events``,
``pending_messages_per_session``, ``pending_event_ids_session``, ``active_jobs``), the files it recorded
(``temp_file_sets``, ``keep_in_cache``, ``GRADIO_CACHE``), whether an event's client is still there
(``Event.alive``: the clean stop, and the page's events, which stop the job of a client that left), the running
event's id (``LocalContext.event_id``), Starlette's cached ``middleware_stack`` (the middleware seam), Gradio's HTTP
routes and request format as the guard reads them (the file, call, queue and upload routes; ``fn_index`` and
``session_hash`` in a call's body and a stream's query), its API description (``Blocks.get_api_info``: the
endpoints' inputs and defaults), its temp folder (``gradio.utils.get_upload_folder``) and its share server
(``gradio.networking.GRADIO_API_SERVER``). (MCP is served by
serving/apis itself, not by Gradio's MCP server.) The admission (the per-client cap, the shutdown
refusal) and the page's Stop need none: the service holds the first (sdxl_engine.service), and a Stop is Gradio
cancelling the event's task (handler.follow). Nothing else in the project touches them: after a Gradio upgrade, read
this module against the new Gradio (and run tests/serving/test_guard_app.py, tests/serving/test_server_shutdown_app.py,
tests/serving/test_janitor_app.py), then move :data:`GRADIO_VERSION`. :func:`check_version` logs one warning
line at start-up when the installed Gradio is another.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import logging
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.exceptions import StarletteDeprecationWarning

if TYPE_CHECKING:  # Gradio itself is imported only where used: server.py imports this module before Gradio's
    # import (usable_output_dir must run first: Gradio reads GRADIO_TEMP_DIR at import).
    from gradio.queueing import Queue

LOG = logging.getLogger(__name__)

GRADIO_VERSION = "6.31.0"  # what this module was checked against: requirements.txt's pin

# Gradio uses Starlette names deprecated since (HTTP_422_UNPROCESSABLE_ENTITY): warnings in the
# server log per request that only Gradio can act on.
warnings.filterwarnings("ignore", category=StarletteDeprecationWarning, module=r"gradio(\.|$)")


def check_version(log=LOG.warning, installed: str | None = None) -> bool:
    """Whether the installed Gradio (or ``installed``) is :data:`GRADIO_VERSION`; if not, log one warning line."""
    installed = installed or importlib.metadata.version("gradio")
    if installed == GRADIO_VERSION:
        return True
    log(f"[app] warning: Gradio {installed} is installed, but sdxl_engine/serving/gradio_internals.py was checked "
        f"against Gradio {GRADIO_VERSION} (requirements.txt): the HTTP guard, the clean stop and the temp-folder "
        "janitor use Gradio internals that may have changed")
    return False


# ---- the demo's events ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EventFn:
    """One of the demo's events that runs a server function.

    Attributes:
        fn_index: the id clients send as ``fn_index`` (``BlockFunction._id``).
        api_name: its API name (``generate``), or None.
        public: whether it is a public API endpoint (``api_visibility == "public"``).
        queued: whether it runs through Gradio's queue (else the page calls it through ``run/predict``).
    """

    fn_index: int
    api_name: str | None
    public: bool
    queued: bool


def event_fns(demo) -> list[EventFn]:
    """The demo's events that run a server function (events with only a page script are left out)."""
    return [EventFn(fn._id, fn.api_name, fn.api_visibility == "public", bool(fn.queue))
            for fn in demo.fns.values() if fn.fn is not None]


def api_name_of(demo, fn_index) -> str | None:
    """The API name of the event ``fn_index`` names (with or without a server function), or None."""
    fn = demo.fns.get(fn_index)
    return None if fn is None else fn.api_name


def fn_indices(demo, api_names) -> list[int]:
    """The ``fn_index`` of every event named one of ``api_names``."""
    return [fn._id for fn in demo.fns.values() if fn.api_name in api_names]


# ---- the queue -------------------------------------------------------------------------------
def queue_of(demo) -> Queue | None:
    """The demo's Gradio queue (made by ``demo.queue(...)``), or None."""
    return getattr(demo, "_queue", None)


def waiting(demo) -> int:
    """Calls waiting in the demo's queue (not running yet)."""
    queue = queue_of(demo)
    return 0 if queue is None else len(queue)


def queue_idle(demo) -> bool:
    """Whether the demo's queue runs nothing and holds nothing."""
    queue = queue_of(demo)
    if queue is None:
        return True
    return all(job is None for job in getattr(queue, "active_jobs", [])) and len(queue) == 0


def session_stream_known(demo, session: str) -> bool:
    """Whether the queue has a result stream (``queue/data``) for ``session``."""
    queue = queue_of(demo)
    return queue is not None and session in queue.pending_messages_per_session


def event_pending(demo, event_id: str) -> bool:
    """Whether ``event_id``'s result is still to be read: the event is queued or running, or its
    completion not yet delivered (Gradio keeps the id in ``pending_event_ids_session`` until then)."""
    queue = queue_of(demo)
    if queue is None:
        return False
    return event_id in queue.event_ids_to_events or any(
        event_id in ids for ids in list(queue.pending_event_ids_session.values()))


def live_events(demo) -> list:
    """The events the demo's queue holds now, queued or running (Gradio ``Event``s: ``_id``, ``session_hash``,
    ``alive``), a copy: for :func:`undelivered` once they have run."""
    queue = queue_of(demo)
    return [] if queue is None else list(queue.event_ids_to_events.values())


def undelivered(demo, events) -> list:
    """Of ``events`` (from :func:`live_events`), those whose result is still to reach a client that is still there:
    the event is ``alive`` (Gradio's ``clean_events`` clears it when the session's result stream closes) and its id
    is still in ``pending_event_ids_session`` (the stream removes it once it has written the completion)."""
    queue = queue_of(demo)
    if queue is None:
        return []
    return [event for event in events
            if event.alive and event._id in queue.pending_event_ids_session.get(event.session_hash, ())]


def current_event_id() -> str | None:
    """The id of the event whose function runs in this context (Gradio's ``LocalContext.event_id``, set for each
    call), or None outside an event."""
    from gradio.context import LocalContext

    return LocalContext.event_id.get(None)


def event_alive(demo, event_id: str) -> bool:
    """Whether the queued event ``event_id`` still has a client: its ``Event.alive``, which Gradio's
    ``Queue.clean_events`` clears when the session's result stream closes (the client left). True for an event the
    queue does not hold (not queued, or already finished)."""
    queue = queue_of(demo)
    if queue is None:
        return True
    for job_set in list(getattr(queue, "active_jobs", [])):
        for event in job_set or ():
            if event._id == event_id:
                return bool(event.alive)
    event = queue.event_ids_to_events.get(event_id)
    return True if event is None else bool(event.alive)


# ---- the files Gradio recorded ----------------------------------------------------------------
def temp_folder(demo) -> Path:
    """The demo's temp folder (``GRADIO_TEMP_DIR``), resolved."""
    return Path(demo.GRADIO_CACHE).resolve()


def file_sets(demo) -> list[set]:
    """The sets in which Gradio records the files the app created (each request's gallery PNGs);
    live: removing a path from one makes Gradio forget it.

    Two kinds: the demo's components' own sets (``Blocks.temp_file_sets``) and those of the per-session copies
    Gradio makes of a component when an event returns an update for it (``gr.update()``, ``gr.skip()``, a component
    instance: ``Blocks.postprocess_data`` stores ``block.__class__(**kwargs)`` in the session's ``SessionState``,
    ``state_holder.session_data[...].blocks_config.blocks``). From then on that session's outputs of the component
    are postprocessed by the copy and recorded in the copy's set, which ``temp_file_sets`` does not list: without
    them one error on the page (whose failure event leaves the gallery as it is, an update) made every later image
    of that browser tab "not a file of this app" for the guard.
    """
    sets = list(demo.temp_file_sets)
    seen = {id(file_set) for file_set in sets}
    originals = [(block_id, block) for block_id, block in list(demo.blocks.items()) if _holds_files(block)]
    if not originals:
        return sets
    for state in list(demo.state_holder.session_data.values()):
        blocks = state.blocks_config.blocks
        for block_id, original in originals:
            copy = blocks.get(block_id)
            file_set = getattr(copy, "temp_files", None)
            if copy is not original and file_set is not None and id(file_set) not in seen:
                seen.add(id(file_set))
                sets.append(file_set)
    return sets


def _holds_files(block) -> bool:
    """Whether ``block`` is a component whose values are files (its data model holds FileData: Gallery, Image,
    ImageEditor, File...): the only components whose session copies record files. Known per class."""
    return _class_holds_files(type(block))


@functools.cache
def _class_holds_files(cls) -> bool:
    from gradio.data_classes import FileData

    model = getattr(cls, "data_model", None)
    model = model if isinstance(model, type) else None  # a property on some classes: such ones hold no files here
    try:
        fields = model.model_json_schema() if model is not None else {}
    except Exception:  # a data model pydantic cannot describe: not a file component of this page
        return False
    return FileData.__name__ in json.dumps(fields)


def upload_files(demo) -> set:
    """The live set of absolute paths Gradio's upload route wrote (``Blocks.upload_file_set``, also the first of
    :func:`file_sets`): files clients sent, which the app never serves back (guard.app_files)."""
    return demo.upload_file_set


def kept_files(demo) -> set:
    """Files Gradio keeps for good (``keep_in_cache``: examples), never deleted."""
    return set().union(*(getattr(block, "keep_in_cache", set()) for block in list(demo.blocks.values())))


# ---- the ASGI app ------------------------------------------------------------------------------
def add_outermost_middleware(app, middleware, **options) -> None:
    """Add ``middleware`` outside every other middleware of the (already started) Starlette ``app``.

    Starlette builds the middleware stack on the first request and refuses ``add_middleware``
    after that; Gradio adds its CORS middleware inside ``launch``. The stack is reset, so it is
    rebuilt with ``middleware`` outermost (the other layers are stateless).
    """
    app.middleware_stack = None
    app.add_middleware(middleware, **options)


# ---- Gradio's HTTP routes and request format (guard.Routes and guard.Guard read them) ----------------------------
# Each with and without the ``/gradio_api`` prefix (Gradio 6 answers both). Checked against gradio.routes.App's own
# routes and gradio.data_classes.PredictBody by tests/serving/test_gradio_internals.py.
FILE_ROUTE = re.compile(r"^(?:/gradio_api)?/(?P<kind>file=|file/|proxy=)(?P<path>.*)$", re.S)  # files, proxied URLs
RESULT_STREAM = re.compile(r"^(?:/gradio_api)?/call/(?:v2/)?(?P<name>[^/]+)/(?P<event>[^/]+)/?$")  # a raw call's result
QUEUE_DATA = re.compile(r"^(?:/gradio_api)?/queue/data/?$")  # a session's result stream (?session_hash=)
DIRECT_CALL = re.compile(r"^(?:/gradio_api)?/(?:call/v2|call|run|api)/(?P<name>[^/]+)/?$")  # a call by API name
API_CALL = re.compile(r"^(?:/gradio_api)?/(?:call|run|api)/(?!v2/)(?P<name>[^/]+)/?$")  # ... whose body has "data"
QUEUE_JOIN = re.compile(r"^(?:/gradio_api)?/queue/join/?$")  # the page's queued call ("fn_index" names the event)
UPLOAD_PATH = "/gradio_api/upload"  # the upload route the page's components use
UPLOAD_ROUTES = ("/gradio_api/upload", "/upload")  # every upload route (upload_progress too)
# Routes this page never uses (guard.Guard refuses them): deep_link writes a session's values (which a client sets)
# into the temp folder; process_recording writes an uploaded video; stream/ feeds streaming components; dev/reload
# and the vibe-* editor are for development.
UNUSED_ROUTES = tuple(prefix + route for prefix in ("/gradio_api", "") for route in (
    "/deep_link", "/process_recording", "/stream/", "/dev/", "/vibe-edit", "/undo-vibe-edit", "/vibe-code"))


def join_fields(payload: dict) -> tuple[object, object]:
    """(``fn_index``, ``session_hash``) of a queue join's or direct call's JSON body (PredictBody), as sent."""
    return payload.get("fn_index"), payload.get("session_hash")


def is_file_data(value) -> bool:
    """Whether ``value`` (a call's JSON) is one file as Gradio's components take it (``FileData``: a string
    ``path`` and ``meta`` ``{"_type": "gradio.FileData"}``, which Gradio's check of a file input requires: anything
    else sent to a file input is a traceback in its log)."""
    return isinstance(value, dict) and isinstance(value.get("path"), str) \
        and value.get("meta") == {"_type": "gradio.FileData"}


def stream_session(query: str) -> str:
    """The ``session_hash`` a result stream's query string (``queue/data?session_hash=...``) names ("" if none)."""
    return dict(pair.partition("=")[::2] for pair in query.split("&")).get("session_hash", "")


def api_endpoints(demo) -> dict[str, tuple[tuple[str, object], ...]]:
    """{api_name: ((parameter name, its default: what gradio_client sends when it is not given), ...)} of the demo's
    public API endpoints, in order, from Gradio's API description (``Blocks.get_api_info``)."""
    named = demo.get_api_info()["named_endpoints"]
    return {name.lstrip("/"): tuple((p["parameter_name"], p.get("parameter_default")) for p in info["parameters"])
            for name, info in named.items()}


def upload_folder() -> str:
    """Gradio's temp folder, where it writes uploads and serves files from (``gradio.utils.get_upload_folder``:
    GRADIO_TEMP_DIR, read at import)."""
    from gradio.utils import get_upload_folder

    return get_upload_folder()


def share_server() -> str:
    """The server Gradio asks for a share link (``gradio.networking.GRADIO_API_SERVER``)."""
    from gradio.networking import GRADIO_API_SERVER

    return GRADIO_API_SERVER
