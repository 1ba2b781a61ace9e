"""The page's events: one /generate call (or image to image, or the gallery's Upscale), from the widgets' values
to the gallery, as a client of the service (sdxl_engine.service).

:func:`api_function` is the ``/generate`` endpoint's function (its parameters name the API's inputs),
:func:`image_function` and :func:`upscale_function` the page's image events: each builds the service's request
(service.request.to_request), submits it as the caller's job and follows it (:func:`follow`: progress, previews,
Stop), then writes the PNGs where Gradio serves them, builds the browser history's record (history.py) and turns
the service's typed errors into what the page shows (gr.Error, gr.Warning): only the page does that.
:func:`page_defaults` gives the page its sliders' defaults before the engine has loaded the model. Imports Gradio.
"""

from __future__ import annotations

import asyncio
import html
import inspect
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import numpy as np

from sdxl_engine.checkpoint.loading import engine_defaults
from sdxl_engine.config import MODEL_DEFAULT_FIELDS, EngineConfig, resolve_defaults
from sdxl_engine.engine.contract import EngineContract, clock
from sdxl_engine.engine.errors import CompilesBusy, EngineNotReady, GenerationError, ModelUnavailable
from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.engine.steps import StepEvent
from sdxl_engine.engine.validation import InvalidRequest
from sdxl_engine.service import delivery
from sdxl_engine.service.images import png_bytes, write_new
from sdxl_engine.service.jobs import QUEUED, SUCCEEDED, Job
from sdxl_engine.service.request import Request, to_request
from sdxl_engine.service.service import Refused, Service
from sdxl_engine.service.styles import NO_STYLE
from sdxl_engine.serving import admission, gradio_internals, guard, history
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.tools import (
    generate_doc,
    generate_inputs,
    image_event_inputs,
    request_values,
    signature_of,
    upscale_event_inputs,
)

LOG = logging.getLogger(__name__)

STAGES = {  # engine stage -> (progress fraction, what the page says)
    "compiling": (0.03, "Compiling {size} once{about} (the first request at it; reused afterwards)"),
    "waiting": (0.04, "Waiting for the request ahead on the devices"),
    "preparing": (0.05, "Preparing: tokenizing the prompts, scheduling {steps} {sampler} steps"),
    "on device": (0.1, "On {devices}: encoding the prompts, denoising {steps} steps, decoding with the VAE"),
    "to host": (0.9, "Copying {n} images to the host"),
    "encoding": (0.95, "Encoding PNGs"),  # the service's, after the engine
}


def page_defaults(config: EngineConfig) -> EngineConfig:
    """``config`` with the model's engine_defaults.json where it set nothing (config.resolve_defaults):
    the page's sampler, steps and guidance, which are also the API's defaults (read before the engine
    has loaded the model, which resolves them the same way; a hub id's file is read only then, so the
    page keeps the config's values for it).

    Raises ConfigError or ModelLoadError for a file the engine would refuse too.
    """
    return resolve_defaults(config, engine_defaults(config.model), config.model)


def api_function(requests: Service, config: EngineConfig, pending: history.Pending,
                 finished: history.Pending | None = None, demo=None, following: PageJobs | None = None) -> Callable:
    """The function the page's Generate event runs, which is also the ``/generate`` API endpoint.

    Its parameter names are the API's keyword inputs, its defaults the page's (``config``: the
    page's resolved defaults); it submits the request to ``requests`` (the service: its line, the per-client cap
    for every front) as the caller's job (:func:`follow`), keeps the history record in ``pending`` for
    the caller's session (and ``{"gallery": items, "info": info}`` in ``finished``, if given: the
    page shows it again after a Stop), and yields (preview gallery, None) while the engine runs, then (gallery
    items, info); ``demo``: the page, whose result streams tell when a caller has left (:func:`client_gone`).
    Its inputs and docstring are the MCP ``generate`` tool's (apis/tools.py: a unit test holds them together);
    Gradio's API page describes ``/generate`` from them.
    """

    signature = signature_of(generate_inputs(config), *GRADIO_PARAMETERS)

    async def generate(*args, **kwargs):
        # The parameters are /generate's inputs (apis/tools.generate_inputs, :func:`with_signature`): gradio_client
        # callers use these keywords (the /generate contract); only optional inputs are ever added, at the end.
        # ``request`` and ``progress`` are Gradio's. An async generator, so the previews stream to the gallery and
        # a cancel (the page's Stop, gradio_client's job.cancel()) is Gradio cancelling this task at an await:
        # follow() stops the job.
        values = bound(signature, args, kwargs)
        request, progress = values.pop("request"), values.pop("progress")
        try:
            fields = request_values(left_out(values, config, values["model"], request))
        except ApiError as err:
            LOG.info(f"[app] request refused: {err.message}")
            raise gr.Error(err.message, print_exception=False) from None
        async for out in follow(requests, _page_request(fields, request), request, progress, pending, finished,
                                client_gone(demo), following=following):
            yield out

    generate.__doc__ = generate_doc()  # the MCP tool's description too (apis/tools.py)
    return with_signature(generate, signature)


# Gradio's own parameters after an endpoint's inputs: the caller's request (by its annotation) and the progress
# tracker (by its default), which Gradio passes in their places.
GRADIO_PARAMETERS = (inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                       annotation=gr.Request),
                     inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress()))


def with_signature(fn: Callable, signature: inspect.Signature) -> Callable:
    """``fn`` (which takes ``*args, **kwargs`` and reads them with :func:`bound`) made to show ``signature``: the
    parameters Gradio reads (inspect.signature: the API's input names and defaults, gr.Progress's place) and their
    annotations (typing.get_type_hints: gr.Request's place)."""
    fn.__signature__ = signature
    fn.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                          if p.annotation is not inspect.Parameter.empty}
    return fn


def bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """{parameter name: value} of one call (``args``, ``kwargs``: by position as Gradio calls, or by keyword) of a
    function showing ``signature``, the defaults filled in. Raises TypeError as Python does for a call that does
    not fit (a missing prompt, an unknown keyword)."""
    call = signature.bind(*args, **kwargs)
    call.apply_defaults()
    return dict(call.arguments)


GRADIO_CLIENT = ("x-gradio-user", "api")  # the header gradio_client sends with every call (Client.submit)


def left_out(values: dict, config: EngineConfig, model: str | None, gr_request) -> dict:
    """``values`` (an endpoint's, by /generate's names) with the sampler, steps and guidance read as left out
    (None: the named model's own default, as A1111, MCP and the jobs API take a value left out) where a
    gradio_client call naming a ``model`` sends the page's default for them (``config``'s, the default model's:
    gradio_client fills an input its caller leaves out with the API description's default, the page's widget
    value, so it cannot send "left out"; it says who it is with :data:`GRADIO_CLIENT`). A value other than that
    default is the caller's own, and the page's calls (its widgets follow the chosen model) are kept as sent."""
    headers = getattr(gr_request, "headers", None) or {}
    if not model or headers.get(GRADIO_CLIENT[0]) != GRADIO_CLIENT[1]:
        return values
    return {name: None if name in MODEL_DEFAULT_FIELDS and value == getattr(config, name) else value
            for name, value in values.items()}


def _page_request(values: dict, gr_request, fields: dict | None = None, paste_back=None) -> Request:
    """The service's request for a page event's ``values`` (/generate's names) and further GenerateRequest
    ``fields``, the caller's address as its client. Raises gr.Error for an unknown style (one log line)."""
    try:
        return to_request(**values, client=admission.client_address(gr_request), paste_back=paste_back,
                          **(fields or {}))
    except InvalidRequest as err:
        raise refuse(err) from err


async def follow(requests: Service, asked: Request, gr_request, progress=None,
                 pending: history.Pending | None = None, finished: history.Pending | None = None,
                 gone: Callable[[], bool] | None = None, front: str = "page", following: PageJobs | None = None):
    """What the page's events run (/generate, image to image, the gallery's Upscale, the MCP image tool):
    ``asked`` submitted to ``requests`` as the caller's job (its owner: the caller's address,
    admission.client_address; its arrival: guard.arrival_time; ``front``: "mcp" for the MCP image tool), followed
    by its events: the stages and steps reported to ``progress``, the latest preview yielded as (preview gallery,
    None) (nothing before the first one, so the wait's progress line stays on the page); at the end the PNGs
    written into Gradio's upload folder for the gallery, the history record kept in ``pending`` and the gallery in
    ``finished`` for the caller's session (if given), and (gallery, info) yielded.

    A Stop (the page's, gradio_client's ``job.cancel()``) is Gradio cancelling this task (or closing this
    generator) at an await: the job is stopped (Service.stop: a queued one leaves the line and never runs, a
    running one stops after its running step). So is a job whose client has left (``gone()``, asked at each event
    and every :data:`EVENT_WAIT_S`: :func:`client_gone`). The job is in ``following`` (if given) under the
    caller's session while this runs, for the page's Stop to reach it should Gradio's cancel not
    (:meth:`PageJobs.stop_left`). The service's typed errors become gr.Error (:func:`page_error`)."""
    try:
        job = requests.submit(asked, owner=admission.client_address(gr_request), front=front,
                              arrived=guard.arrival_time(gr_request))
    except (InvalidRequest, EngineNotReady) as err:
        raise refuse(err, asked) from err
    except Refused as err:  # the service logged it
        raise gr.Error(shown(err.message), print_exception=False) from err
    session = getattr(gr_request, "session_hash", None)
    if following is not None:
        following.add(session, job)
    try:
        shown_now, folder, seen = [], [], 0
        while not job.done:
            events = await job.next_events(seen, timeout=EVENT_WAIT_S)
            seen += len(events)
            if gone is not None and not job.cancelled.is_set() and gone():
                LOG.info(f"[app] a page request's client left: stopping it ({job.status})")
                requests.stop(job, "its client left")
            previews = [data for name, data in events if name == "preview"]
            for name, data in events:
                if progress is not None and name != "preview":
                    _report(requests.engine, job, name, data, progress)
            if previews and job.preview is not None:  # the latest only: those before it are already old
                step = StepEvent(previews[-1]["step"], previews[-1]["steps"], job.preview)
                shown_now = _preview_gallery(step, folder) or shown_now
                yield shown_now, None
        gallery, info, record = _delivered(job)
    finally:
        if not job.done:  # cancelled (the task, or the generator closed): the job stops too
            requests.stop(job)
        if following is not None:
            following.discard(session, job)
    if pending is not None:
        pending.put(session, record)
    if finished is not None:
        finished.put(session, {"gallery": gallery, "info": info})
    yield gallery, info


class PageJobs:
    """The jobs the page's request events follow (:func:`follow`), by the caller's Gradio session: what the page's
    Stop stops should Gradio's cancel of the event not reach :func:`follow` (Gradio closes a generator it cancelled
    between two of its steps only through its own bookkeeping; a generator it lost would leave its job running on
    the devices until the last step). Thread-safe; a job leaves when :func:`follow` ends or when it is done."""

    def __init__(self, requests: Service):
        self.requests = requests
        self._jobs: dict[str, set[Job]] = {}
        self._lock = threading.Lock()

    def add(self, session: str | None, job: Job) -> None:
        with self._lock:
            for jobs in self._jobs.values():  # the finished ones of every session go (their follow() may be lost)
                jobs.difference_update([held for held in jobs if held.done])
            self._jobs = {held: jobs for held, jobs in self._jobs.items() if jobs}
            self._jobs.setdefault(session or "", set()).add(job)

    def discard(self, session: str | None, job: Job) -> None:
        with self._lock:
            self._jobs.get(session or "", set()).discard(job)

    def running(self, session: str | None) -> list[Job]:
        """The jobs of ``session`` not done yet."""
        with self._lock:
            return [job for job in self._jobs.get(session or "", ()) if not job.done]

    def stop_left(self, heard: str, request: gr.Request) -> None:
        """The page's Stop, once its cancel is through (the failed event's follow-up; ``heard``: where the Stop
        found the request, STOP_STEP_JS, "" when the event failed without a Stop): every job of the caller's
        session still running and not stopped is stopped (Service.stop: after its running step), with one log line
        each; one already stopping is left as it is. Updates nothing on the page."""
        if heard:
            for job in self.running(getattr(request, "session_hash", None)):
                if not job.cancelled.is_set():
                    LOG.info(f"[app] a page request still ran after its Stop: stopping it ({job.status})")
                    self.requests.stop(job)


def client_gone(demo) -> Callable[[], bool] | None:
    """Whether the caller of the page event running in this context has left: Gradio marks the event gone when
    its session's result stream closes (a closed tab, a client that went: gradio_internals.event_alive). None where
    there is nothing to watch (no demo, or not a queued event: MCP calls the function itself)."""
    event_id = gradio_internals.current_event_id()
    if demo is None or event_id is None:
        return None
    return lambda: not gradio_internals.event_alive(demo, event_id)


# How the engine's warnings about the prompts begin (engine/plan.Planner.warnings); a style's words may be the cause.
PROMPT_WARNINGS = ("prompt", "negative prompt")
EVENT_WAIT_S = 1.0  # the longest follow() waits for a job's next event before it looks again


def _report(engine: EngineContract, job: Job, name: str, data: dict | None, progress) -> None:
    """Tell ``progress`` (a gr.Progress) about one of ``job``'s events: its place in line, the engine's stage
    (:data:`STAGES`), a denoising step (``(k, N)`` steps, with the job's time left)."""
    req = job.request.engine
    if name == "queued" and job.status == QUEUED:  # still in line (not a place it has left already)
        ahead = data["position"] if data else 0
        text = STAGES["waiting"][1] + (f" ({ahead} more ahead in line)" if ahead else "")
        progress(STAGES["waiting"][0], desc=text)
    elif name == "stage" and data["stage"] == "loading":
        progress(0.0, desc=f"Starting the engine: {engine.stage} ({clock() - engine.started:.0f} s)")
    elif name == "stage":
        limits = engine.limits
        fraction, text = STAGES.get(data["stage"], (None, data["stage"]))
        size = f"{req.width or limits.default_size[0]}x{req.height or limits.default_size[1]}"
        compile_s = engine.startup.get("compile_s", 0.0)  # the start's compile: 0 when it came from the cache
        steps = limits.default_steps if req.num_inference_steps is None else req.num_inference_steps
        progress(fraction, desc=text.format(steps=steps, sampler=req.sampler or limits.default_sampler,
                                            devices=engine.device_summary, n=engine.batch, size=size,
                                            about=f", about {compile_s:.0f} s" if compile_s >= 1 else ""))
    elif name == "step":
        left = job.eta_s or 0.0
        progress((data["step"], data["steps"]), unit="steps",
                 desc=f"Denoising: step {data['step']}/{data['steps']}, about {left:.0f} s left")


def _delivered(job: Job) -> tuple[list, dict, dict]:
    """(gallery items, info, history record) of a finished ``job``: its PNGs written into Gradio's upload folder
    (one new folder, served as it is), its warnings shown (gr.Warning). Raises gr.Error for a failed or
    cancelled job (:func:`page_error`) or PNGs that could not be written."""
    if job.status != SUCCEEDED:
        raise page_error(job.error, job.request) if job.error is not None else gr.Error(
            shown((job.result.stopped if job.result is not None else None) or "the request was cancelled"),
            print_exception=False)
    result, style = job.result, job.request.style
    try:
        paths = delivery.write_served(result.pngs, result.stems, Path(gradio_internals.upload_folder()))
    except OSError as err:
        LOG.error(f"[app] error: could not write the images to Gradio's temp folder: {err}")
        raise gr.Error(f"the server could not store the images ({type(err).__name__}); please retry later",
                       print_exception=False) from err
    info, label = result.info, "" if style == NO_STYLE else f" · {style}"
    gallery = [(path, f"seed {s}{label} · {info['latency_s']:.2f} s") for path, s in zip(paths, result.seeds)]
    for warning in result.warnings:  # the engine's, about the prompts, and the outputs folder's
        styled = style != NO_STYLE and warning.startswith(PROMPT_WARNINGS)
        gr.Warning(f"{warning} (the {style} style adds words around yours)" if styled else warning)
    record = history.make_record({"prompt": job.request.prompt, "negative_prompt": job.request.negative_prompt,
                                  "style": style}, info, result.images)
    return gallery, info, record


def page_error(err: BaseException, asked: Request | None = None) -> gr.Error:
    """The page's pop-up for a job's typed error (the service logged it): the engine's message for a refused
    value (under the front's name of the field: ``asked``'s Request.field), an engine that did not start, a model
    that could not be loaded, a request that could not be made or a busy compiler; for anything else a message
    without internals."""
    if isinstance(err, (InvalidRequest, EngineNotReady, GenerationError, CompilesBusy, ModelUnavailable)):
        return gr.Error(shown(message_of(err, asked)), print_exception=False)
    return gr.Error(f"the engine failed on this request ({type(err).__name__}); it is logged on the server. "
                    "Please retry.", print_exception=False)


def image_function(requests: Service, config: EngineConfig, pending: history.Pending,
                   finished: history.Pending | None, demo, following: PageJobs | None = None) -> Callable:
    """The function of the page's "Generate from image" event (api_name ``img2img``, private: the page's own).

    Its inputs (apis/tools.image_event_inputs: /generate's, in the page's widgets, but the ControlNet unit's, with
    the event's own after the first nine): the image editor's value (image_input: the event does not preprocess),
    the mode (image_input.MODES), strength, the outpaint sides and pixels. /generate's go into the request as its
    own do (tools.request_values: the refiner switch, 1 = none; the model, "" = the default; every other by its
    name). It reads the editor's picture and mask (image_input.read_editor: only uploads and the app's own PNGs of
    ``demo``; on a worker thread, off the event loop), builds the engine fields and paste-back
    (image_input.request_fields) and runs as /generate does (:func:`follow`: the service's job, previews, Stop,
    history record with the settings, not the picture). Every upload it was given is deleted when it ends, whatever
    the outcome, unless the editor uploaded it again since this request arrived (:func:`discard_uploads`). A
    picture the page cannot use is gr.Error with apis.uploads' or image_input's message.
    """
    # Here, not at the top: importing serving.apis (image_input decodes with apis.uploads) runs the package's
    # __init__, whose routes import this module.
    from sdxl_engine.serving import image_input
    from sdxl_engine.serving.apis.errors import ApiError

    signature = signature_of(image_event_inputs(config), *GRADIO_PARAMETERS)

    async def img2img(*args, **kwargs):
        values = bound(signature, args, kwargs)  # the parameters: tools.image_event_inputs (with_signature)
        request, progress = values.pop("request"), values.pop("progress")
        image, mode, strength, sides, pixels = (values.pop(name) for name in ("image", "mode", "strength", "sides",
                                                                              "pixels"))
        arrived = guard.arrival_time(request)
        since = clock() if arrived is None else arrived

        def prepared():
            picture = image_input.read_editor(image, lambda path: readable(demo, path))
            return image_input.request_fields(picture, mode, strength, _whole(values["width"]),
                                              _whole(values["height"]), sides, _whole(pixels))

        try:
            try:
                asked = await asyncio.to_thread(prepared)
                fields = request_values(values)
            except ApiError as err:
                raise refuse(ValueError(err.message)) from err
            job_request = _page_request(fields, request, asked.fields, asked.finish)
            async for out in follow(requests, job_request, request, progress, pending, finished,
                                    client_gone(demo), following=following):
                yield out
        finally:
            discard_uploads(demo, image_input.editor_paths(image), since)

    return with_signature(img2img, signature)


def upscale_function(requests: Service, config: EngineConfig, pending: history.Pending,
                     finished: history.Pending | None, demo, following: PageJobs | None = None) -> Callable:
    """The function of the gallery's "Upscale (hires fix)" event (api_name ``upscale``, private: the page's own).

    Its inputs (apis/tools.upscale_event_inputs: /generate's, in the page's widgets, but the ControlNet unit's and
    the refiner switch, with the event's own after the first nine): the last finished request (server state) and
    the gallery index selected, the hires scale, upscaler (a pixel one: image_upscale.IMAGE_UPSCALERS) and
    strength. /generate's go into the request as its own do (tools.request_values). The selected
    image (the app's own PNG) is the hires fix's first pass: the engine upscales it and denoises it again at the
    larger size, with that image's seed (so the same click gives the same images) and the page's prompt and
    settings; its size is the image's (the Resolution is not read). Runs as /generate does (:func:`follow`).
    """
    from sdxl_engine.serving import image_input
    from sdxl_engine.serving.apis.errors import ApiError
    from sdxl_engine.serving.apis.uploads import open_image

    signature = signature_of(upscale_event_inputs(config), *GRADIO_PARAMETERS)

    async def upscale(*args, **kwargs):
        values = bound(signature, args, kwargs)  # the parameters: tools.upscale_event_inputs (with_signature)
        request, progress = values.pop("request"), values.pop("progress")
        last, index, hires_scale, hires_upscaler, hires_strength = (
            values.pop(name) for name in ("last", "index", "hires_scale", "hires_upscaler", "hires_strength"))
        if not last or type(index) is not int or not 0 <= index < len(last.get("gallery") or []):
            raise refuse(ValueError("image: select an image of the last result in the gallery first"))
        path = last["gallery"][index][0]
        path = path.get("path") if isinstance(path, dict) else path
        try:
            if not isinstance(path, str) or not readable(demo, path):
                raise ApiError(400, "image: not an image this page made", "image")
            picture = await asyncio.to_thread(
                lambda: np.asarray(open_image(image_input.read_file(path, "image"), "image", "RGB")))
        except ApiError as err:
            raise refuse(ValueError(err.message)) from err
        seeds = (last.get("info") or {}).get("seeds") or []
        values.update(seed=seeds[index] if index < len(seeds) else values["seed"], width=0, height=0)  # the image's
        try:
            fields = request_values(values)
        except ApiError as err:
            raise refuse(ValueError(err.message)) from err
        hires = dict(image=picture, hires_scale=hires_scale, hires_upscaler=hires_upscaler,
                     hires_strength=hires_strength)
        async for out in follow(requests, _page_request(fields, request, hires), request, progress, pending,
                                finished, client_gone(demo), following=following):
            yield out

    return with_signature(upscale, signature)


def _whole(value):
    """``value`` as an int when it is a whole number (the page's Number and Slider send floats); else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def readable(demo, path: str) -> bool:
    """Whether the image event may read ``path``: a file Gradio's upload route wrote (guard.Routes let only
    images through) or one the app created (guard.app_files: a gallery PNG sent to the editor)."""
    full = os.path.abspath(path)
    return full in gradio_internals.upload_files(demo) or full in guard.app_files(demo)


def discard_uploads(demo, paths: list[str], since: float | None = None) -> None:
    """Delete each of ``paths`` that is an upload (never the app's own PNGs), and its folder when empty, through
    guard.UPLOADS: not while another upload is being written, nor one uploaded again at or after ``since`` (the
    request's arrival, contract.clock(); None: now): Gradio names an upload by its content, so that path is
    another upload's too (the janitor deletes what is kept). Gradio forgets each everywhere but its upload set,
    so guard.Routes never serves that path (module guard)."""
    uploads = gradio_internals.upload_files(demo)
    named = [path for path in {os.path.abspath(p) for p in paths if isinstance(p, str)} if path in uploads]
    for path in named:
        for files in gradio_internals.file_sets(demo):
            if files is not uploads:
                files.discard(path)
    guard.UPLOADS.remove(named, clock() if since is None else since)


def _preview_gallery(event: StepEvent, folder: list) -> list:
    """The gallery item [(PNG path, ``preview · step k/N``)] of ``event.preview`` ((n, h, w, 3) uint8): the batch
    in one grid image (previews.preview_grid, as A1111 shows a batch's live preview), or [] if it could not be
    written (the gallery keeps what it showed; the request goes on).

    One file per preview, not n: gradio_client fetches every file of every streamed message again. Written once by
    images.png_bytes (no parameters chunk) into this request's folder in
    Gradio's temp folder (``folder``: [] until the first preview makes it, then [its path]), which Gradio
    serves as it is. A numpy array would be encoded by Pillow at its default level and hashed by the
    Gallery at every yield of it, the keep-alive repeats included.
    """
    try:
        if not folder:
            root = Path(gradio_internals.upload_folder()).resolve()
            root.mkdir(parents=True, exist_ok=True)
            folder.append(Path(tempfile.mkdtemp(prefix="sdxl-preview-", dir=root)))
        path = write_new(png_bytes(preview_grid(event.preview)), folder[0], f"step{event.step}")
        return [(str(path), f"preview · step {event.step}/{event.steps}")]
    except OSError as err:
        LOG.warning(f"[app] warning: could not write a preview to Gradio's temp folder: {err}")
        return []


def refuse(err: Exception, asked: Request | None = None) -> gr.Error:
    """The gr.Error for a request the engine refused (bad input, not started) or that failed with
    a message for the user (an unusable image, a lost Ray replica: GenerationError), after one
    log line that says which: neither is a traceback in the server log. ``asked``: the request, whose front names
    the fields (:func:`message_of`)."""
    message = message_of(err, asked)
    if isinstance(err, GenerationError):  # the request could not be made: the operator may want to know
        LOG.error(f"[app] request failed: {message}")
    else:  # the client's to change (or to retry once the engine is ready): nothing wrong with the server
        LOG.info(f"[app] request refused: {message}")
    return gr.Error(shown(message), print_exception=False)


def message_of(err: BaseException, asked: Request | None = None) -> str:
    """What a client reads of ``err``: an InvalidRequest's field under the front's name (``asked``'s
    Request.field: MCP's ``upscale`` for ``hires_scale``) and its message; any other error's text."""
    if isinstance(err, InvalidRequest) and asked is not None:
        return f"{asked.field(err.field)}: {err.message}"
    return str(err)


def shown(message: str) -> str:
    """A message for gr.Error, whose pop-up on the page renders HTML: ``&``, ``<`` and ``>`` as HTML
    entities, so the pop-up shows the text as it was (a ``<lora:x:9>`` tag the message quotes can be
    copied back into the prompt) and nothing a client sent becomes an element. Clients that read the
    message as text (the protocol APIs: apis/core.py) unescape it (html.unescape)."""
    return html.escape(message, quote=False)
