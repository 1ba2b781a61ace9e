"""serving/apis/core.generate as one job of its owner: a request of several engine calls keeps the images
its finished calls made when it is interrupted, a skip drops only the running call, and the job's id
reaches every engine call. The calls go through a real request service (service.RequestService) whose handler is
scripted (no app, no engine)."""

import asyncio
import dataclasses
import io
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.steps import Stopped
from sdxl_engine.engine.validation import InvalidRequest, Limits
from sdxl_engine.service.images import png_bytes
from sdxl_engine.serving.apis import core
from sdxl_engine.serving.apis.core import Call, Interrupted
from sdxl_engine.serving.guard import RequestGate
from sdxl_engine.serving.progress import JOBS
from sdxl_engine.serving.service import RequestService

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                default_guidance=5.0, multiple=16, default_sampler="Euler")
OWNER = ("a1111", "10.1.2.3")


class Engine:
    limits, batch, error = LIMITS, 4, None

    def __init__(self):
        self.ready = threading.Event()
        self.ready.set()


class RouteRequest:
    """The parts of a route's Starlette request core.generate reads: its client, headers and connection."""

    def __init__(self, host: str = "10.1.2.3"):
        self.client, self.headers = SimpleNamespace(host=host), {}

    async def is_disconnected(self) -> bool:
        return False


def scripted_service(tmp_path, script, limit: int = 2) -> tuple[RequestService, list]:
    """A request service whose handler, for call k, begins it as handle_generate does, runs ``script[k](job)`` (it
    may interrupt or skip), then answers the gallery, info and PNGs for the seeds it was asked for, or raises the
    handler's stop error (the page's message from the typed Stopped) if the job's call was stopped. Returns the
    service and the calls' (seed, job id, keep, the request handed on built) as they came."""
    calls = []

    def handle(engine, *values, job, client, keep, arrived, extra=None, request=None):
        if True:  # in the slot service.RequestService.run holds
            seed = values[2]
            calls.append((seed, job, keep, request))
            JOBS.begin_call(job, 8)
            script[len(calls) - 1](job)
            if JOBS.stop_requested(job):  # as handler.handle_generate answers a stopped call
                raise RuntimeError("the request was stopped after step 3 of 8") from Stopped(
                    "stopped after step 3 of 8")
            gallery, pngs = [], []
            for i in range(4):
                path = tmp_path / f"call{len(calls)}-{i}.png"
                pngs.append(png_bytes(np.full((2, 2, 3), seed + i, np.uint8)))
                path.write_bytes(b"the served file: an answer takes the bytes from memory, not from here")
                gallery.append((str(path), ""))
            JOBS.deliver(job, pngs)  # as handler.handle_generate hands its PNGs to the job
            return gallery, {"seeds": [seed + i for i in range(4)], "width": 64, "height": 64}, {}

    return RequestService(Engine(), handle, RequestGate(), slots=1, limit=limit, log=lambda line: None), calls


def run(service, call, host="10.1.2.3"):
    return asyncio.run(core.generate(service, RouteRequest(host), call, OWNER))


def nothing(job):
    pass


def test_every_call_of_a_request_carries_its_one_job_and_the_job_closes(tmp_path):
    service, calls = scripted_service(tmp_path, [nothing] * 4)
    made = run(service, Call("a red circle", seed=10, images=10))
    assert [c[0] for c in calls] == [10, 14, 18] and [c[2] for c in calls] == [None, None, 2]  # the last keeps 2
    assert len({c[1] for c in calls}) == 1 and made.seeds == list(range(10, 20)) and made.stopped is None
    # each image's PNG is the one its call delivered for its seed, in order (progress.Jobs.take_pngs)
    assert [int(np.asarray(Image.open(io.BytesIO(png)))[0, 0, 0]) for png in made.pngs] == made.seeds
    assert JOBS.snapshot(OWNER).job is None  # closed
    assert service.held("10.1.2.3") == 0 and service.slots.taken == 0  # its place and slot given back


def test_the_first_call_runs_the_checked_request_and_nothing_validates_it_again(tmp_path):
    """check builds the request as the page does (the style applied, the client's address) and validates it; the
    first engine call gets that object, which validate hands back as it is (validated once); the next calls, of
    other seeds, get none (the handler builds theirs, which the engine validates)."""
    from sdxl_engine.engine.validation import validate

    service, calls = scripted_service(tmp_path, [nothing] * 2)
    run(service, Call("a red circle", seed=10, images=8, style="Cinematic", num_inference_steps=3))
    first = calls[0][3]
    assert first.seed == 10 and first.num_inference_steps == 3 and first.client == "10.1.2.3"
    assert first.prompt.startswith("cinematic still a red circle") and first.validated_for == LIMITS
    assert validate(first, LIMITS) is first and calls[1][3] is None
    changed = dataclasses.replace(first, num_inference_steps=500)  # a changed copy is not validated: refused
    with pytest.raises(InvalidRequest, match="^num_inference_steps: "):
        validate(changed, LIMITS)
    other = dataclasses.replace(LIMITS, max_steps=2)  # validated for other limits: validated for these
    with pytest.raises(InvalidRequest, match="^num_inference_steps: "):
        validate(first, other)


def test_an_interrupt_in_a_later_call_answers_the_finished_calls_images(tmp_path):
    service, calls = scripted_service(tmp_path, [nothing, lambda job: JOBS.interrupt(OWNER), nothing, nothing])
    made = run(service, Call("a red circle", seed=10, images=16))
    assert len(calls) == 2  # no call after the interrupt
    assert made.seeds == [10, 11, 12, 13] and len(made.pngs) == 4
    assert made.stopped == "the request was stopped after step 3 of 8" and made.info["seeds"] == [10, 11, 12, 13]


def test_a_skip_drops_the_running_call_only_and_the_seeds_follow_on(tmp_path):
    service, calls = scripted_service(tmp_path, [nothing, lambda job: JOBS.skip(OWNER), nothing])
    made = run(service, Call("a red circle", seed=10, images=12))
    assert [c[0] for c in calls] == [10, 14, 18]
    assert made.seeds == [10, 11, 12, 13, 18, 19, 20, 21] and made.stopped.startswith("the request was stopped")


def test_an_interrupt_before_any_image_is_interrupted(tmp_path):
    service, _ = scripted_service(tmp_path, [lambda job: JOBS.interrupt(OWNER)] + [nothing] * 3)
    with pytest.raises(Interrupted, match="^the request was stopped after step 3 of 8$"):
        run(service, Call("a red circle", seed=10, images=16))
    assert JOBS.snapshot(OWNER).job is None


def test_another_clients_interrupt_stops_nothing(tmp_path):
    service, _ = scripted_service(tmp_path, [lambda job: JOBS.interrupt(("a1111", "10.9.9.9")),
                                             lambda job: JOBS.interrupt(("gradio", "x"))])
    made = run(service, Call("a red circle", seed=1, images=8))
    assert made.seeds == list(range(1, 9)) and made.stopped is None


def test_the_handlers_typed_error_reaches_the_protocol_as_its_status(tmp_path):
    """Not by its message: a refusal the engine makes only at run time (a sampler the model's scheduler rules
    out, a new size while others compile) keeps its type through the service, whatever its text says."""
    from sdxl_engine.engine.errors import CompilesBusy

    for error, status in ((InvalidRequest("sampler", "DDIM cannot run this model"), 400),
                          (CompilesBusy("width/height: 2 new sizes compile already"), 429),
                          (RuntimeError("the request was stopped, it says"), 500)):
        def handle(engine, *values, error=error, **kwargs):
            raise RuntimeError(str(error)) from error

        service = RequestService(Engine(), handle, RequestGate(), slots=1, limit=1)
        with pytest.raises(core.ApiError) as err:
            run(service, Call("a red circle", seed=1))
        assert err.value.status == status and not isinstance(err.value, Interrupted) and err.value.message == str(error)
        assert service.held("10.1.2.3") == 0


def test_the_handlers_page_escaped_message_reaches_an_api_client_as_text():
    """The handler's refusals are HTML-escaped for the page's pop-up (handler.shown); the protocol APIs answer
    the text itself, with the real < > & a client can copy back."""
    import gradio as gr

    from sdxl_engine.serving.handler import shown

    message = "prompt: '<lora:x:9>': the weight must be between -4 and 4 & more"

    def handle(engine, *values, **kwargs):
        raise gr.Error(shown(message), print_exception=False)

    service = RequestService(Engine(), handle, RequestGate(), slots=1, limit=1)
    with pytest.raises(core.ApiError) as caught:
        run(service, Call("a red circle", seed=10, images=4))
    assert caught.value.status == 500 and caught.value.message == message


def test_a_client_over_its_limit_or_a_closing_server_is_refused_before_anything_runs(tmp_path):
    """The service's admission: the client's own protocol requests and its Gradio calls count together
    (gradio_held: admission.Admission.held); during a shutdown every request is refused with 503."""
    service, calls = scripted_service(tmp_path, [nothing] * 4, limit=2)
    service.gradio_held = lambda client: 2 if client == "10.1.2.3" else 0
    with pytest.raises(core.ApiError) as over:
        run(service, Call("a red circle", seed=1))
    assert over.value.status == 429 and "max_requests_per_client = 2" in over.value.message
    assert over.value.headers == {"Retry-After": "5"} and calls == []
    assert run(service, Call("a red circle", seed=1), host="10.7.7.7").seeds == [1, 2, 3, 4]  # another address
    service.gate.close()
    with pytest.raises(core.ApiError) as closing:
        run(service, Call("a red circle", seed=1), host="10.7.7.7")
    assert closing.value.status == 503 and closing.value.message == "the server is shutting down; retry in a minute"


def test_a_client_that_leaves_during_a_call_gets_no_further_calls(tmp_path):
    """A request of 12 images whose client disconnects while its first engine call runs: that call finishes, no
    other runs (the engine makes no images for no one), and the job closes."""
    service, calls = scripted_service(tmp_path, [nothing] * 3)
    request = RouteRequest()
    gone = []

    async def is_disconnected() -> bool:
        return bool(gone)

    request.is_disconnected = is_disconnected
    script_first = service.handle

    def handle(engine, *values, **kwargs):
        answer = script_first(engine, *values, **kwargs)
        gone.append(True)  # the client leaves while this call runs
        return answer

    service.handle = handle
    made = asyncio.run(core.generate(service, request, Call("a red circle", seed=10, images=12), OWNER))
    assert [c[0] for c in calls] == [10] and made.seeds == [10, 11, 12, 13]
    assert made.stopped == "the request was stopped before it started" and JOBS.snapshot(OWNER).job is None
