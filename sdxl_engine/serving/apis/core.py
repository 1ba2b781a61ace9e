"""One generation for every protocol: the page's checks, then the request service.

A protocol route (a1111.py, openai_images.py) turns its request into a :class:`Call` (the
``/generate`` inputs plus how many images), and :func:`generate` runs it:

1. waits for the engine's start (as the page's requests do), then builds the engine's request as the
   page's calls do (handler.build_request: the style applied) and validates it (validation.validate),
   so a bad value is refused before it takes a place, with the page's message (:class:`ApiError`,
   400); the first engine call runs that request, which nothing validates again;
2. takes a place in the request service (service.RequestService.admitted: the per-client cap,
   counted with the client's Gradio calls; refused while the server shuts down), then runs each
   engine call through the service (service.RequestService.run: the same handler,
   handler.handle_generate, in one of the same slots as the page's calls, in order of arrival);
3. takes the PNGs the handler made (with their A1111 ``parameters`` chunk) from memory and its
   info record. More images than one engine call makes run as further calls, one after another,
   with the seeds following on.

No answer carries a server path: the PNGs travel as bytes, and a URL (openai_images.py) names
an opaque token (:class:`FileTokens`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import secrets
import threading
from pathlib import Path

from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, validate
from sdxl_engine.service.styles import NO_STYLE, UnknownStyle
from sdxl_engine.serving import admission, guard
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.handler import ProtocolInputs, build_request, generate_values
from sdxl_engine.serving.progress import JOBS, Owner
from sdxl_engine.serving.service import Failed, Refused, RequestService

LOG = logging.getLogger(__name__)

MAX_CALLS = 4  # engine calls one API request may ask for (n, batch_size x n_iter): 4 x the engine's batch images


class Interrupted(ApiError):
    """The request was stopped before it made any image (its owner's interrupt or skip of every call): 409.
    A1111's txt2img answers it as A1111 does an interrupted job: 200 with the images it has (none)."""

    def __init__(self, message: str):
        super().__init__(409, message)




@dataclasses.dataclass(frozen=True)
class Call:
    """One protocol request in ``/generate``'s terms (app.py's inputs; None = the engine's default).

    ``images``: how many images the client asked for, 1 to :data:`MAX_CALLS` x the engine's batch;
    0 = one engine call's batch. ``field_names`` maps a ``/generate`` input to the protocol's own
    field name, so refusals name the field the client sent (``steps``, not ``num_inference_steps``).
    """

    prompt: object
    negative_prompt: object = ""
    seed: object = -1
    guidance_scale: object = None
    num_inference_steps: object = None
    width: object = None
    height: object = None
    style: str | None = NO_STYLE
    sampler: object = None
    images: int = 0
    field_names: tuple[tuple[str, str], ...] = ()
    extra: ProtocolInputs | None = None  # image to image, hires fix, refiner (handler.ProtocolInputs)

    def values(self, seed) -> list:
        """The ``/generate`` event's input values (handler.GENERATE_INPUTS), with ``seed``; then its refiner switch,
        None (the protocol's refiner comes in ``extra``)."""
        return [*generate_values({**vars(self), "seed": seed}), None]

    def field(self, name: str) -> str:
        """The protocol's name of the ``/generate`` input ``name`` (``width/height`` maps each side)."""
        names = dict(self.field_names)
        return "/".join(dict.fromkeys(names.get(part, part) for part in name.split("/")))  # size/size -> size


@dataclasses.dataclass(frozen=True)
class Generated:
    """What :func:`generate` returns: ``pngs`` (PNG bytes, image i made from ``seeds[i]``), the
    handler's ``info`` record of the first engine call that made images (docs/python.md; ``seeds`` lists
    every image's), ``paths``, the served files (for :class:`FileTokens`; never sent to a client), and
    ``stopped``: None, or the message of the interrupt that ended the request before all its calls ran
    (the images are those made until then)."""

    pngs: list[bytes]
    seeds: list[int]
    info: dict
    paths: list[str]
    stopped: str | None = None


def model_name(engine: EngineContract) -> str:
    """The loaded model's name as the page shows it (a local folder by its own name, never its path);
    before the model is loaded, the setting, cut to its last part if it is a folder."""
    if engine.model is not None:
        return engine.model.name
    setting = engine.config.model
    return Path(setting).name if Path(setting).is_dir() else setting


def engine_batch(engine: EngineContract) -> int:
    """Images one engine call makes (4 until the engine has started: the usual batch)."""
    return engine.batch or 4


def check(engine: EngineContract, call: Call, client: str = "") -> GenerateRequest:
    """Refuse ``call`` as the page would, before it is queued; the engine must have started. Returns the engine's
    request for its first engine call (handler.build_request, validated: the engine does not validate it again),
    ``client`` its client address.

    Raises:
        ApiError: 503 the engine failed to start; 400 an unknown style, a value the engine's
            validation refuses (its message, the field renamed to the protocol's), or an image
            count outside 1 to MAX_CALLS x the batch.
    """
    if engine.error is not None:
        raise ApiError(503, f"the engine failed to start: {engine.error}")
    batch = engine_batch(engine)
    if not 0 <= call.images <= MAX_CALLS * batch:
        raise ApiError(400, f"{call.field('images')}: this server makes 1 to {MAX_CALLS * batch} images per request "
                            f"({MAX_CALLS} engine calls of {batch}), got {call.images}", call.field("images"))
    try:
        request, _style = build_request(*generate_values(vars(call)), client=client,
                                        fields=call.extra.fields if call.extra is not None else None)
    except UnknownStyle as err:
        raise ApiError(400, str(err).replace("style:", f"{call.field('style')}:", 1), call.field("style")) from None
    try:
        return validate(request, engine.limits)
    except InvalidRequest as err:
        raise refused_field(err, call) from None


async def wait_started(engine: EngineContract, poll_s: float = 0.25) -> None:
    """Wait (without a thread) until the engine has finished starting, well or not."""
    while not engine.ready.is_set():
        await asyncio.sleep(poll_s)


async def generate(service: RequestService, request, call: Call, owner: Owner) -> Generated:
    """Run ``call`` (see the module docstring) as one job of ``owner`` (progress.JOBS: its progress counts
    every engine call; ``owner``'s interrupt stops it, its skip ends the running call and the next one runs);
    ``request`` is the route's Starlette request (its client address, arrival time and connection).

    Raises:
        ApiError: :func:`check`'s refusals; 429/503 from the service's admission (over the per-client limit,
            shutting down); :class:`Interrupted` (409) when the request was stopped before it made any image;
            429 when the engine is compiling as many new sizes as it may; 400 a value the engine refused;
            500 with the handler's message when the engine failed on the request (its details are in the
            server log only).
    """
    engine = service.engine
    await wait_started(engine)
    client = admission.client_address(request)
    try:
        checked = check(engine, call, client)
    except ApiError as err:  # one line, as the handler logs the page's refusals (handler.refuse)
        LOG.info(f"[app] request refused: {err.message}")
        raise
    try:
        with service.admitted(client):  # one place for all the request's engine calls
            return await _run_calls(service, request, call, owner, client, checked)
    except Refused as err:  # raised on entry only: nothing ran
        raise ApiError(err.status, err.message, headers={"Retry-After": str(err.retry_after_s)}) from None


async def _run_calls(service: RequestService, request, call: Call, owner: Owner, client: str,
                     checked: GenerateRequest) -> Generated:
    """:func:`generate`'s engine calls, one after another, the seeds following on; the first runs ``checked``
    (:func:`check`'s request), the next ones the request of their own seed."""
    engine = service.engine
    batch = engine_batch(engine)
    wanted = call.images or batch
    calls = math.ceil(wanted / batch)
    pngs, seeds, paths, first_info, seed, stopped = [], [], [], None, call.seed, None
    job = JOBS.open(owner, calls)
    try:
        for n in range(calls):
            keep = wanted - n * batch  # of this call's images, the ones the client receives (and outputs_dir gets)
            try:
                made = await service.run(call.values(seed), request=checked if n == 0 else None, job=job,
                                         client=client, keep=keep if keep < batch else None, extra=call.extra,
                                         arrived=guard.arrival_time(request), left=request.is_disconnected)
            except Failed as err:
                if not err.stopped:
                    raise _api_error(err, call) from None
                stopped = err.message
                if JOBS.interrupted(job) or await request.is_disconnected():  # no further calls
                    break
                # a skip (A1111's /skip): this call's batch is dropped, the next follows on from its seeds
                seed = seed if seed == -1 else (seed + batch) % (engine.limits.max_seed + 1)
                continue
            first_info = first_info or made.info
            for path, png, image_seed in zip(made.paths, made.pngs, made.info["seeds"]):
                if len(pngs) < wanted:
                    pngs.append(png)
                    seeds.append(image_seed)
                    paths.append(path)
            seed = (made.info["seeds"][0] + batch) % (engine.limits.max_seed + 1)  # the next call follows on
    finally:
        JOBS.close(job)
    if first_info is None:  # stopped before any image was made
        raise Interrupted(stopped or "the request was stopped")
    return Generated(pngs, seeds, {**first_info, "seeds": seeds}, paths,
                     stopped if len(pngs) < wanted else None)


def _api_error(err: Failed, call: Call) -> ApiError:
    """The protocol's answer to an engine call that failed (not stopped): 429 busy compiling (retry in 30 s),
    400 a value the engine refused (an InvalidRequest's field under the protocol's name: the size or steps a run
    cannot take, engine/memory.py and durations.py), else 500."""
    if err.busy:
        return ApiError(429, err.message, headers={"Retry-After": "30"})
    if isinstance(err.cause, InvalidRequest):
        return refused_field(err.cause, call)
    return ApiError(400 if err.bad_value else 500, err.message)


def refused_field(err: InvalidRequest, call: Call) -> ApiError:
    """The 400 of a value the engine refused, its field under the name the protocol's client sent (``steps``, not
    ``num_inference_steps``): before the call (check) or when the engine weighed what it would cost."""
    field = call.field(err.field)
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
