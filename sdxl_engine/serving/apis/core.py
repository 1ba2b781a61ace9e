"""What every protocol front shares: its request built by keyword (:func:`request_of`: service.request.to_request
with the protocol's field names), checked at the door (:func:`check`), queued as a job of its owner
(:func:`submit`, :func:`owner_of`), awaited (:func:`finished`: a client that leaves stops it) and its failure turned
into the protocol's status (:func:`job_error`, :func:`refused_field`); :func:`generate` does all of it for a
front that answers when the images are made (A1111, OpenAI). The service (sdxl_engine/service) runs the engine
calls; a request of more images than one call makes runs further calls, the seeds following on.

No answer carries a server path: the PNGs travel as bytes (encoded once, by the service), and a URL
(openai_images.py) names an opaque token (:class:`FileTokens`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import secrets
import threading
from pathlib import Path

from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.errors import CompilesBusy, EngineNotReady, GenerationError, InvalidRequest, ModelUnavailable
from sdxl_engine.engine.validation import validate
from sdxl_engine.service import models
from sdxl_engine.service.jobs import FAILED, Job
from sdxl_engine.service.request import MAX_CALLS, Request, to_request
from sdxl_engine.service.service import Refused, Service
from sdxl_engine.serving import admission, guard
from sdxl_engine.serving.apis.errors import ApiError

LOG = logging.getLogger(__name__)

LEFT_POLL_S = 0.5  # how often a waiting protocol request asks whether its client is still there (finished)


class Interrupted(ApiError):
    """The request was stopped before it made any image (its owner's interrupt or skip of every call): 409.
    A1111's txt2img answers it as A1111 does an interrupted job: 200 with the images it has (none)."""

    def __init__(self, message: str):
        super().__init__(409, message)




@dataclasses.dataclass(frozen=True)
class Generated:
    """What :func:`generate` returns: ``pngs`` (PNG bytes, image i made from ``seeds[i]``), the
    ``info`` record of the first engine call that made images (docs/python.md; ``seeds`` lists
    every image's), ``stems``, the images' file names without ``.png`` (for a front that writes files), and
    ``stopped``: None, or the message of the interrupt that ended the request before all its calls ran
    (the images are those made until then)."""

    pngs: list[bytes]
    seeds: list[int]
    info: dict
    stems: list[str]
    stopped: str | None = None


def model_name(engine: EngineContract) -> str:
    """The default model's name as the page shows it (a local folder by its own name, never its path); before the
    model is loaded, the setting, cut to its last part if it is a folder (service/models.default)."""
    return models.default(engine)


def engine_batch(engine: EngineContract) -> int:
    """Images one engine call makes (4 until the engine has started: the usual batch)."""
    return engine.batch or 4


def owner_of(request, key: str = "") -> str:
    """Who owns a request a route's Starlette ``request`` makes (who may see and stop it: progress, cancel, the
    jobs API): the API key where the server has one (``key``: every holder of it is one owner), else the client's
    address (admission.client_address, the per-client cap's identity)."""
    return f"key:{hashlib.sha256(key.encode()).hexdigest()[:16]}" if key else admission.client_address(request)


async def wait_started(engine: EngineContract, poll_s: float = 0.25) -> None:
    """Wait (without a thread) until the engine has finished starting, well or not."""
    while not engine.ready.is_set():
        await asyncio.sleep(poll_s)


def request_of(field_names: tuple[tuple[str, str], ...] = (), **values) -> Request:
    """service.request.to_request for a protocol's ``values`` (by ``/generate``'s names), with the protocol's
    ``field_names`` (``(("num_inference_steps", "steps"), ...)``) so that refusals name the fields its client sent.

    Raises ApiError 400: an unknown style, under the protocol's name of the field."""
    try:
        return to_request(**values, field_names=dict(field_names))
    except InvalidRequest as err:
        raise ApiError(400, f"{dict(field_names).get(err.field, err.field)}: {err.message}",
                       dict(field_names).get(err.field, err.field)) from None


def check(engine: EngineContract, asked: Request, client: str = "") -> Request:
    """Refuse ``asked`` as the service would, before anything is queued; the engine must have started. Returns it
    for ``client`` (its address: the engine's per-client compile limit), its engine request validated (the service
    does not validate it again).

    Raises:
        ApiError: 503 the engine failed to start; 400 an unknown style, a value the engine's validation refuses
            (its message, the field renamed to the protocol's; the model's own limits once it is loaded), an unknown
            model (naming the models offered), or an image count outside 1 to MAX_CALLS x the batch.
    """
    if engine.error is not None:
        raise ApiError(503, f"the engine failed to start: {engine.error}")
    batch = engine_batch(engine)
    if not 0 <= asked.images <= MAX_CALLS * batch:
        raise ApiError(400, f"{asked.field('images')}: this server makes 1 to {MAX_CALLS * batch} images per "
                            f"request ({MAX_CALLS} engine calls of {batch}), got {asked.images}", asked.field("images"))
    try:
        limits = models.limits_for(engine, asked.engine.model)  # an unknown model: refused naming those offered
        return dataclasses.replace(asked, engine=validate(dataclasses.replace(asked.engine, client=client), limits))
    except InvalidRequest as err:
        raise refused_field(err, asked) from None


async def submit(requests: Service, request, asked: Request, front: str, owner: str,
                 job_id: str | None = None) -> Job:
    """Queue ``asked`` in the service for ``owner`` (core.owner_of) from ``front``; ``request`` is the route's
    Starlette request (its client address and arrival time).

    Raises ApiError: 503 the engine failed to start, or the service is shutting down or full; 429 over the
    client's cap (with Retry-After); 400 a value the engine's validation refuses (its field under the protocol's
    name), an unknown style, an image count outside 1 to MAX_CALLS x the batch."""
    engine = requests.engine
    await wait_started(engine)
    client = admission.client_address(request)
    try:
        return requests.submit(check(engine, asked, client), owner=owner, front=front, job_id=job_id, client=client,
                               arrived=guard.arrival_time(request))
    except ApiError as err:
        LOG.info(f"[app] request refused: {err.message}")
        raise
    except InvalidRequest as err:  # the job id (A1111's force_task_id) in use
        refusal = refused_field(err, asked)
        LOG.info(f"[app] request refused: {refusal.message}")
        raise refusal from None
    except Refused as err:
        raise ApiError(err.status, err.message, headers={"Retry-After": str(err.retry_after_s)}) from None


async def finished(requests: Service, job: Job, request=None) -> Job:
    """Wait (without a thread) until ``job`` has finished; a client that leaves meanwhile (``request``'s
    ``is_disconnected``, asked every :data:`LEFT_POLL_S`) stops it (queued: it never runs; running: after the
    running step), so the next caller does not wait for images no one will read."""
    seen = 0
    while not job.done:
        seen += len(await job.next_events(seen, timeout=LEFT_POLL_S))
        if request is not None and not job.done and not job.cancelled.is_set() and await request.is_disconnected():
            LOG.info("[app] a protocol request's client left: stopping it")
            requests.stop(job, "its client left")
    return job


def job_error(job: Job, asked: Request | None = None) -> ApiError:
    """The protocol's answer to a job that failed: 429 busy compiling (retry in 30 s), 400 a value the engine
    refused (its field under the protocol's name: the size or steps a run cannot take, engine/memory.py and
    durations.py), 503 the engine not ready or the request's model could not be loaded (the others serve on), else
    500 (the details are in the server log only)."""
    err = job.error
    if isinstance(err, CompilesBusy):
        return ApiError(429, str(err), headers={"Retry-After": "30"})
    if isinstance(err, InvalidRequest):
        return refused_field(err, asked) if asked is not None else ApiError(400, str(err), err.field)
    if isinstance(err, (EngineNotReady, ModelUnavailable)):
        return ApiError(503, str(err))
    if isinstance(err, GenerationError):
        return ApiError(500, str(err))
    return ApiError(500, f"the engine failed on this request ({type(err).__name__}); it is logged on the server. "
                         "Please retry.")


async def generate(requests: Service, request, asked: Request, front: str, owner: str,
                   job_id: str | None = None) -> Generated:
    """Run ``asked`` as one job of ``owner`` (see the module docstring) and wait for it; ``request`` is the route's
    Starlette request (its client address, arrival time and connection).

    Raises:
        ApiError: :func:`submit`'s refusals; :class:`Interrupted` (409) when the request was stopped before it
            made any image; :func:`job_error`'s when it failed.
    """
    job = await finished(requests, await submit(requests, request, asked, front, owner, job_id), request)
    if job.status == FAILED:
        raise job_error(job, asked)
    if job.result is None:  # cancelled before any image was made
        raise Interrupted(job.stopped or "the request was stopped")
    made = job.result
    return Generated(made.pngs, made.seeds, made.info, made.stems, made.stopped)


def refused_field(err: InvalidRequest, asked: Request) -> ApiError:
    """The 400 of a value the engine refused, its field under the name the protocol's client sent (``steps``, not
    ``num_inference_steps``): before the call (check) or when the engine weighed what it would cost."""
    field = asked.field(err.field)
    return ApiError(400, f"{field}: {err.message}", field)


class FileTokens:
    """Opaque, unguessable names for served PNGs (``/v1/images/files/<token>.png``), newest ``keep`` kept.

    A token names a file the handler wrote in Gradio's temp folder; the temp-folder janitor may
    delete it later (after ``temp_keep_s``), and then the token answers 404.
    """

    def __init__(self, keep: int = 1024):
        self._paths: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.keep = keep

    def add(self, path: str) -> str:
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._paths[token] = path
            while len(self._paths) > self.keep:
                self._paths.popitem(last=False)
        return token

    def path(self, token: str) -> str | None:
        """The file ``token`` names, if it is known and still on disk."""
        with self._lock:
            path = self._paths.get(token)
        return path if path is not None and Path(path).is_file() else None


MAX_JSON_DEPTH = 64  # levels of [ and { a request body may nest: no field of these APIs needs more than a few


def read_json(raw: bytes) -> object:
    """A protocol request's JSON body, refused whole before any field is read when a client's value
    could not be answered: every string (keys and values, at any depth) must be Unicode text that
    UTF-8 can carry, so a reply that echoes it (A1111's ``parameters`` and ``info``) cannot fail later.

    ``raw``: the body's bytes (UTF-8 JSON). Returns the parsed value (any JSON type; an empty body is
    None). Raises ApiError 400: not JSON; nested deeper than :data:`MAX_JSON_DEPTH`; a string holding a
    lone surrogate (``"\\ud800"`` in JSON text is not a character), with ``param`` the field's path.
    """
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ApiError(400, _too_deep()) from None
    except ValueError:
        raise ApiError(400, "the request body is not JSON") from None
    if (refusal := text_refusal(value)) is not None:
        raise refusal
    return value


def text_refusal(value: object) -> ApiError | None:
    """The 400 for the first string in ``value`` (parsed JSON) that UTF-8 cannot encode, or for nesting
    deeper than :data:`MAX_JSON_DEPTH`; None when there is neither. The field is named by its path
    (``styles[1]``, ``override_settings.sd_vae``); a bad key by its parent's path and the key."""
    stack = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH and isinstance(item, (dict, list)):  # depth 0 is the first level
            return ApiError(400, _too_deep(), path or None)
        if isinstance(item, str):
            if (where := _surrogate_at(item)) is not None:
                return ApiError(400, f"{path or 'the request body'}: {where}", path or None)
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                if (where := _surrogate_at(key)) is not None:
                    field = path or "the request body"
                    return ApiError(400, f"{field}: the key {ascii(key)[:80]} {where}", path or None)
                stack.append((f"{path}.{key}" if path else key, child, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child, depth + 1) for i, child in reversed(list(enumerate(item))))
    return None


def _surrogate_at(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (U+D800 to U+DFFF, half of a UTF-16 pair), said for a message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"holds a lone surrogate (\\u{ord(text[err.start]):04x} at character {err.start}), which is not a "
                "character: send text as UTF-8, or pair each \\ud800-\\udbff escape with a \\udc00-\\udfff one")
    return None


def _too_deep() -> str:
    return (f"the request body is too deeply nested (more than {MAX_JSON_DEPTH} levels of [ or {{): "
            "no field here nests so deep")
