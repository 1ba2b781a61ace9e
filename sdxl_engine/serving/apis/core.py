"""One generation for every protocol: the page's own ``/generate`` event, its queue, its checks.

A protocol route (a1111.py, openai_images.py) turns its request into a :class:`Call` (the
``/generate`` inputs plus how many images), and :func:`generate` runs it:

1. waits for the engine's start (as the page's requests do), then checks the values with the
   engine's own functions (styles.apply_style, validation.validate), so a bad value is refused
   before it takes a place in the queue, with the page's message (:class:`ApiError`, 400);
2. pushes the ``/generate`` event into Gradio's queue (gradio_internals.run_queued): the same
   handler (handler.handle_generate), the same concurrency id and limit, the same per-client
   admission (admission.py: this client is its IP address) and the same drain on shutdown as
   the page and gradio_client;
3. reads back the PNGs the handler wrote (with their A1111 ``parameters`` chunk) and its info
   record. More images than one engine call makes run as further calls, one after another,
   each through the queue, with the seeds following on.

No answer carries a server path: the PNGs travel as bytes, and a URL (openai_images.py) names
an opaque token (:class:`FileTokens`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import secrets
import threading
from pathlib import Path

from fastapi import HTTPException

from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, validate
from sdxl_engine.serving import admission, delivery, gradio_internals
from sdxl_engine.serving.styles import NO_STYLE, UnknownStyle, apply_style

API_NAME = "generate"  # the page's event every protocol runs
MAX_CALLS = 4  # engine calls one API request may ask for (n, batch_size x n_iter): 4 x the engine's batch images


class ApiError(Exception):
    """A refusal or failure to answer in the protocol's own error shape.

    ``status``: the HTTP status (400 bad value, 401 no or wrong key, 404, 429 over the per-client
    limit, 500 the engine failed, 503 not started / shutting down / queue full); ``message``: one
    line for the user (the engine's own for a bad value); ``param``: the request field at fault,
    if one is; ``headers``: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


class Interrupted(ApiError):
    """The request was stopped while it ran (A1111's ``POST /interrupt``, the page's Stop): 409, nothing
    made. A1111's txt2img answers it as A1111 does an interrupted job: 200 with the images it has (none)."""

    def __init__(self, message: str):
        super().__init__(409, message)


STOPPED = "the request was stopped"  # the start of handler.handle_generate's message for a stopped request


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

    def values(self, seed) -> list:
        """The ``/generate`` event's input values, in app.py's order, with ``seed``."""
        return [self.prompt, self.negative_prompt, seed, self.guidance_scale, self.num_inference_steps,
                self.width, self.height, self.style, self.sampler]

    def field(self, name: str) -> str:
        """The protocol's name of the ``/generate`` input ``name`` (``width/height`` maps each side)."""
        names = dict(self.field_names)
        return "/".join(dict.fromkeys(names.get(part, part) for part in name.split("/")))  # size/size -> size


@dataclasses.dataclass(frozen=True)
class Generated:
    """What :func:`generate` returns: ``pngs`` (PNG bytes, image i made from ``seeds[i]``), the
    handler's ``info`` record of the first engine call (README, "API"; ``seeds`` lists every image's)
    and ``paths``, the served files (for :class:`FileTokens`; never sent to a client)."""

    pngs: list[bytes]
    seeds: list[int]
    info: dict
    paths: list[str]


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


def check(engine: EngineContract, call: Call) -> None:
    """Refuse ``call`` as the page would, before it is queued; the engine must have started.

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
        prompt, negative = apply_style(call.style, call.prompt, call.negative_prompt)
    except UnknownStyle as err:
        raise ApiError(400, str(err).replace("style:", f"{call.field('style')}:", 1), call.field("style")) from None
    request = GenerateRequest(prompt=prompt, negative_prompt=negative, seed=call.seed,
                              guidance_scale=call.guidance_scale, num_inference_steps=call.num_inference_steps,
                              width=call.width, height=call.height, sampler=call.sampler)
    try:
        validate(request, engine.limits)
    except InvalidRequest as err:
        field = call.field(err.field)
        raise ApiError(400, field + str(err)[len(err.field):], field) from None


async def wait_started(engine: EngineContract, poll_s: float = 0.25) -> None:
    """Wait (without a thread) until the engine has finished starting, well or not."""
    while not engine.ready.is_set():
        await asyncio.sleep(poll_s)


async def generate(demo, engine: EngineContract, request, call: Call) -> Generated:
    """Run ``call`` (see the module docstring); ``request`` is the route's Starlette request.

    Raises:
        ApiError: :func:`check`'s refusals; 429/503 from the admission (over the per-client limit,
            shutting down) or the queue (full, stopped); :class:`Interrupted` (409) when the request was
            stopped while it ran; 500 with the handler's message when the engine failed on the request
            (its details are in the server log only).
    """
    await wait_started(engine)
    try:
        check(engine, call)
    except ApiError as err:  # one line, as the handler logs the page's refusals (handler.refuse)
        print(f"[app] request refused: {err.message}", flush=True)
        raise
    batch = engine_batch(engine)
    wanted = call.images or batch
    pngs, seeds, paths, first_info, seed = [], [], [], None, call.seed
    for n in range(math.ceil(wanted / batch)):
        keep = wanted - n * batch  # of this call's images, the ones the client receives (and outputs_dir gets)
        info, files = await _one_call(demo, request, call.values(seed), continues=n > 0,
                                      keep=keep if keep < batch else None)
        first_info = first_info or info
        for path, image_seed in zip(files, info["seeds"]):
            if len(pngs) < wanted:
                pngs.append(Path(path).read_bytes())
                seeds.append(image_seed)
                paths.append(path)
        seed = (info["seeds"][0] + batch) % (engine.limits.max_seed + 1)  # the next call follows on
    return Generated(pngs, seeds, {**first_info, "seeds": seeds}, paths)


async def _one_call(demo, request, values: list, continues: bool = False,
                    keep: int | None = None) -> tuple[dict, list[str]]:
    """One ``/generate`` event through the queue: (info record, PNG paths). ``continues``: a later call of
    one request (its images past the first batch), which the per-client limit does not refuse. ``keep``:
    how many of its images the client receives, if fewer than the batch (delivery.KEEP: only they are saved)."""
    scope = {**({admission.CONTINUES: True} if continues else {}),
             **({delivery.KEEP: keep} if keep is not None else {})}
    try:
        ok, output = await gradio_internals.run_queued(demo, API_NAME, values, request, scope=scope or None)
    except HTTPException as err:  # the admission's refusal (admission.Admission._refuse)
        raise ApiError(err.status_code, str(err.detail), headers=dict(err.headers or {})) from None
    except gradio_internals.QueueRefusal as err:
        raise ApiError(err.status, f"the server cannot take this request now ({err.message}); retry later",
                       headers={"Retry-After": "5"}) from None
    if not ok:
        message = str(output.get("error") or "the engine failed on this request")
        raise Interrupted(message) if message.startswith(STOPPED) else ApiError(500, message)
    gallery, info = output["data"]
    return info, gradio_internals.gallery_paths(gallery)


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
