"""The jobs API (``/v1/jobs``): submit a request, follow it by id, fetch its images, cancel it.

A thin front on the service (service/service.py): each route parses its body, builds the request with
service.request.to_request (the names ``/generate`` uses), submits it, and renders the job as JSON. A job is seen and
stopped only by its owner (apis.core.owner_of: the API key where the server has one, else the client's address):
any other caller gets 404 for its id. Finished jobs are kept for a bounded time and memory (``--job-keep-s``,
``--job-keep-mb``); a dropped one answers 410. Errors are OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``), as every ``/v1`` route's.

- ``POST /v1/jobs`` -> 202 ``{"id", "status", "position"}`` at once;
- ``GET /v1/jobs`` -> the caller's jobs, newest first; ``GET /v1/jobs/{id}`` -> the job (:func:`job_record`);
- ``GET /v1/jobs/{id}/events`` -> ``text/event-stream`` of ``queued``, ``started``, ``step``, ``preview``, then
  ``succeeded`` / ``failed`` / ``cancelled`` (the job as GET returns it), then the stream ends;
- ``DELETE /v1/jobs/{id}`` -> 200 with the job (queued: removed; running: stops after its running step).

``callback_url`` (optional): the finished job is POSTed there as JSON, only to hosts the operator lists
(``--callback-host``); any other is refused with 400 naming the field: a server must never call arbitrary URLs for
a client.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sdxl_engine.engine.control import ControlUnit
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.ip_adapter import IPAdapterUnit
from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.service.images import png_bytes
from sdxl_engine.service.jobs import FAILED, RUNNING, SUCCEEDED, Job, JobGone, JobNotFound
from sdxl_engine.service.request import to_request
from sdxl_engine.service.service import Refused, Service
from sdxl_engine.serving import admission, guard
from sdxl_engine.serving.apis.core import job_error, read_json, wait_started
from sdxl_engine.serving.apis.errors import ApiError, openai_error
from sdxl_engine.serving.apis.uploads import decode_image

LOG = logging.getLogger(__name__)

PREFIX = "/v1/jobs"
IMAGES = {"image": "RGB", "mask": "L"}  # fields sent as base64 images, decoded in this mode
# The body's fields: every field of the engine's request (by its own name: a field added there is served here with
# no change), the service's style and image count, and the callback. The engine validates their values.
FIELDS = (*(f.name for f in dataclasses.fields(GenerateRequest) if f.init and f.name != "client"), "style", "images",
          "callback_url")
UNIT_FIELDS = tuple(f.name for f in dataclasses.fields(ControlUnit))  # a control unit's, by ControlUnit's names
IP_UNIT_FIELDS = tuple(f.name for f in dataclasses.fields(IPAdapterUnit))  # an IP-Adapter unit's, likewise
CALLBACK_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet event stream


def job_record(job: Job) -> dict:
    """The job as ``GET /v1/jobs/{id}`` answers it: ``id``, ``status`` (queued, running, succeeded, failed,
    cancelled), ``position`` (its place in line while queued, 0 = next; else null), ``stage`` (while running, the
    engine's stage: "waiting" while another request holds the devices, "compiling", "preparing", "on device", ...;
    else null), ``progress`` (``step``,
    ``steps`` of the running engine call, ``call``, ``calls``, ``fraction`` 0..1 of the whole job), ``images``
    (base64 PNGs, with A1111's ``parameters`` chunk, once succeeded), ``seeds``, ``info`` (docs/python.md's record),
    ``error`` (``{"message", "field"}`` once failed, else null)."""
    result, error = job.result, None
    if job.status == FAILED:
        refusal = job_error(job)
        error = {"message": refusal.message, "field": refusal.param}
    return {
        "id": job.id, "status": job.status, "position": job.position,
        "stage": (job.stage or None) if job.status == RUNNING else None,
        "progress": {"step": job.step, "steps": job.steps, "call": job.call, "calls": job.calls,
                     "fraction": round(job.fraction, 4)},
        "images": [base64.b64encode(png).decode() for png in result.pngs] if result is not None else [],
        "seeds": list(result.seeds) if result is not None else [],
        "info": result.info if result is not None else None,
        "error": error,
    }


def to_job_request(body: object, client: str):
    """The service's request for a ``POST /v1/jobs`` body (a JSON object of :data:`FIELDS`, by the engine's names)
    and its ``callback_url`` (None when absent). ``image`` and ``mask`` are base64 images (decoded here); ``outpaint``
    a list of 4 pixel counts; every other value goes to the engine's validation as sent (its checks name the field).

    Raises ApiError 400 naming the field: not an object, no prompt (absent or null), an unknown field, ``images`` 0, an
    image or mask that does not decode, an unknown style."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object of the request's fields")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not a field of this API; the fields are {', '.join(FIELDS)}", unknown[0])
    if body.get("prompt") is None:  # absent or null: null values below mean "the default", and a prompt has none
        raise ApiError(400, "prompt: required (the text the images should show)", "prompt")
    if body.get("images") == 0 and type(body["images"]) is int:  # 0 is the service's "one call's batch", not a count
        raise ApiError(400, "images: 1 or more (leave it out for one engine call's images), got 0", "images")
    fields = {name: value for name, value in body.items() if value is not None and name != "callback_url"}
    for name, mode in IMAGES.items():
        if name in fields:
            if not isinstance(fields[name], str):
                raise ApiError(400, f"{name}: expected a base64 image (PNG, JPEG or WebP)", name)
            fields[name] = np.asarray(decode_image(fields[name], name, mode))
    if isinstance(fields.get("outpaint"), list):
        fields["outpaint"] = tuple(fields["outpaint"])
    if "control_units" in fields:
        fields["control_units"] = control_units(fields["control_units"])
    if "ip_adapter_units" in fields:
        fields["ip_adapter_units"] = ip_adapter_units(fields["ip_adapter_units"])
    images = fields.pop("images", 0)
    if type(images) is not int:
        raise ApiError(400, f"images: expected a whole number, got {json.dumps(images)[:40]}", "images")
    callback = body.get("callback_url")
    if callback is not None and not isinstance(callback, str):
        raise ApiError(400, "callback_url: expected a URL string", "callback_url")
    try:
        return to_request(**fields, images=images, client=client), callback
    except InvalidRequest as err:
        raise ApiError(400, str(err), err.field) from None


def control_units(units) -> tuple[ControlUnit, ...]:
    """``control_units`` as the engine's ControlUnits: a list of objects of ControlUnit's fields (:data:`UNIT_FIELDS`),
    ``image`` a base64 image (decoded here, RGB), or a list of them for a ControlNet-Union unit (its ``control_type``
    one per image); the engine validates the rest. Raises ApiError 400 naming the
    field: not a list of objects, an unknown field, an image that does not decode."""
    if not isinstance(units, list):
        raise ApiError(400, "control_units: expected a list of objects (ControlNet units)", "control_units")
    made = []
    for i, unit in enumerate(units):
        field = f"control_units[{i}]"
        if not isinstance(unit, dict):
            raise ApiError(400, f"{field}: expected an object of {', '.join(UNIT_FIELDS)}", field)
        if unknown := sorted(set(unit) - set(UNIT_FIELDS)):
            raise ApiError(400, f"{field}.{unknown[0]}: not a field of a unit; the fields are "
                                f"{', '.join(UNIT_FIELDS)}", f"{field}.{unknown[0]}")
        sent = unit.get("image")
        several = isinstance(sent, list) and sent and all(isinstance(v, str) for v in sent)  # a union unit's images
        if not isinstance(sent, str) and not several:
            raise ApiError(400, f"{field}.image: expected a base64 image (PNG, JPEG or WebP), or a list of them for "
                                "a ControlNet-Union unit (one control_type each)", f"{field}.image")
        images = tuple(np.asarray(decode_image(v, f"{field}.image[{k}]" if several else f"{field}.image", "RGB"))
                       for k, v in enumerate(sent if several else [sent]))
        made.append(ControlUnit(**{**unit, "image": images if several else images[0]}))
    return tuple(made)


def ip_adapter_units(units) -> tuple[IPAdapterUnit, ...]:
    """``ip_adapter_units`` as the engine's IPAdapterUnits: a list of objects of IPAdapterUnit's fields
    (:data:`IP_UNIT_FIELDS`), ``image`` a base64 image or a list of them (decoded here, RGB), or for an IP-Adapter
    FaceID ``embeds`` in its place: a face embedding as a list of floats (insightface's ``normed_embedding``, 512) or
    a list of them (passed as they are); the engine validates the rest. Raises ApiError 400 naming the field: not a
    list of objects, an unknown field, an image that does not decode."""
    if not isinstance(units, list):
        raise ApiError(400, "ip_adapter_units: expected a list of objects (IP-Adapter units)", "ip_adapter_units")
    made = []
    for i, unit in enumerate(units):
        field = f"ip_adapter_units[{i}]"
        if not isinstance(unit, dict):
            raise ApiError(400, f"{field}: expected an object of {', '.join(IP_UNIT_FIELDS)}", field)
        if unknown := sorted(set(unit) - set(IP_UNIT_FIELDS)):
            raise ApiError(400, f"{field}.{unknown[0]}: not a field of a unit; the fields are "
                                f"{', '.join(IP_UNIT_FIELDS)}", f"{field}.{unknown[0]}")
        if unit.get("image") is None and unit.get("embeds") is not None:  # FaceID: the engine checks the floats
            made.append(IPAdapterUnit(**unit))
            continue
        several = isinstance(unit.get("image"), list)
        texts = unit["image"] if several else [unit.get("image")]
        images = []
        for k, text in enumerate(texts):
            name = f"{field}.image[{k}]" if several else f"{field}.image"
            if not isinstance(text, str):
                raise ApiError(400, f"{name}: expected a base64 image (PNG, JPEG or WebP)", name)
            images.append(np.asarray(decode_image(text, name, "RGB")))
        made.append(IPAdapterUnit(**{**unit, "image": tuple(images) if several else images[0]}))
    return tuple(made)


def callback_refusal(url: str, hosts: tuple[str, ...]) -> ApiError | None:
    """The 400 for a ``callback_url`` the server may not call: not http(s), or its host not one the operator
    listed (``--callback-host``); None when it may."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ApiError(400, "callback_url: expected an http or https URL", "callback_url")
    if not hosts:
        return ApiError(400, "callback_url: this server calls no callback URLs (its operator lists the hosts it may "
                             "call with --callback-host); poll GET /v1/jobs/{id} or follow /events instead",
                        "callback_url")
    if parts.hostname.lower() not in {h.lower() for h in hosts}:
        return ApiError(400, f"callback_url: {parts.hostname[:80]!r} is not a host this server may call "
                             f"({', '.join(hosts)})", "callback_url")
    return None


def router(requests: Service, owner_of: Callable, callback_hosts: tuple[str, ...] = ()) -> APIRouter:
    """The ``/v1/jobs`` routes (see the module docstring) on ``requests``; ``owner_of(request)`` is who owns
    a route's jobs (core.owner_of); ``callback_hosts`` the hosts ``callback_url`` may name."""
    api = APIRouter(prefix=PREFIX, tags=["jobs"])
    engine = requests.engine
    callbacks: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks

    def find(job_id: str, request: Request) -> Job | JSONResponse:
        """The caller's job ``job_id``, or the answer that it is not there: 404 (none of the caller's: another
        owner's is not found either), 410 (finished and dropped)."""
        try:
            return requests.get(job_id, owner_of(request))
        except JobGone:
            return openai_error(ApiError(410, f"job {job_id[:80]!r} finished and its result is no longer kept "
                                              f"(results are kept {requests.store.keep_s:g} s)"))
        except JobNotFound:
            return openai_error(ApiError(404, f"no job {job_id[:80]!r} of yours here"))

    @api.post("", status_code=202, summary="Submit a generation; answers at once with the job's id")
    async def submit(request: Request):
        try:
            client = admission.client_address(request)
            asked, callback = await asyncio.to_thread(to_job_request, read_json(await request.body()), client)
            if callback is not None and (refusal := callback_refusal(callback, callback_hosts)) is not None:
                raise refusal
            await wait_started(engine)
            try:
                job = requests.submit(asked, owner=owner_of(request), front="jobs", client=client,
                                      arrived=guard.arrival_time(request))
            except InvalidRequest as err:
                raise ApiError(400, str(err), err.field) from None
            except Refused as err:
                raise ApiError(err.status, err.message, headers={"Retry-After": str(err.retry_after_s)}) from None
        except ApiError as err:
            LOG.info(f"[app] request refused: {PREFIX}: {err.message}")
            return openai_error(err)
        if callback is not None:
            task = asyncio.create_task(_call_back(job, callback))
            callbacks.add(task)
            task.add_done_callback(callbacks.discard)
        return JSONResponse({"id": job.id, "status": job.status, "position": job.position}, status_code=202,
                            headers={"Location": f"{PREFIX}/{job.id}"})

    @api.get("", summary="Your jobs, newest first")
    async def list_jobs(request: Request):
        return {"jobs": [{"id": j.id, "status": j.status, "position": j.position}
                         for j in requests.jobs(owner_of(request))]}

    @api.get("/{job_id}", summary="A job: status, place in line, progress, and its images once succeeded")
    async def get_job(job_id: str, request: Request):
        job = find(job_id, request)
        return job if isinstance(job, JSONResponse) else job_record(job)

    @api.delete("/{job_id}", summary="Cancel a job: queued, it leaves the line; running, it stops within a step")
    async def cancel_job(job_id: str, request: Request):
        job = find(job_id, request)
        if isinstance(job, JSONResponse):
            return job
        requests.stop(job)
        if not job.done:  # running: wait (without a thread) for the step that is running to end
            await asyncio.wait_for(job.finished_result(), timeout=None)
        return job_record(job)

    @api.get("/{job_id}/events", summary="The job's events as Server-Sent Events, until it ends")
    async def job_events(job_id: str, request: Request):
        job = find(job_id, request)
        if isinstance(job, JSONResponse):
            return job
        return StreamingResponse(_stream(job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _call_back(job: Job, url: str) -> None:
        """POST the finished job to ``url`` (one try; one log line if it fails)."""
        await job.finished_result()
        try:
            async with httpx.AsyncClient(timeout=CALLBACK_TIMEOUT_S, follow_redirects=False) as client:
                answer = await client.post(url, json=job_record(job))
            LOG.info(f"[app] job {job.id} {job.status}: callback answered {answer.status_code}")
        except httpx.HTTPError as err:
            LOG.warning(f"[app] job {job.id}: its callback failed ({type(err).__name__})")

    return api


async def _stream(job: Job, request: Request):
    """The Server-Sent Events of ``job`` from its first: each as ``event: <name>`` and ``data: <JSON>``; a preview
    as its grid PNG in base64 (the latest only, when the follower is behind); the last carries the job."""
    seen = 0
    while True:
        events = await job.next_events(seen, timeout=KEEPALIVE_S)
        if not events:
            if await request.is_disconnected():
                return
            yield ": keep-alive\n\n"
            continue
        seen += len(events)
        last_preview = max((i for i, (name, _) in enumerate(events) if name == "preview"), default=None)
        for i, (name, data) in enumerate(events):
            if name == "stage":
                continue
            if name == "preview":
                if i != last_preview or job.preview is None:
                    continue
                data = {**data, "image": base64.b64encode(png_bytes(preview_grid(job.preview))).decode()}
            if name in (SUCCEEDED, FAILED, "cancelled"):
                yield f"event: {name}\ndata: {json.dumps(job_record(job))}\n\n"
                return
            yield f"event: {name}\ndata: {json.dumps(data or {})}\n\n"
