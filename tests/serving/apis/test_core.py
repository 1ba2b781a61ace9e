"""serving/apis/core.generate as one job of its owner in the service (service/service.py): a request of several
engine calls keeps the images its finished calls made when it is interrupted, a skip drops only the running call,
the first call runs the request checked at the door, and the service's refusals and the engine's typed errors reach
the protocol as their status. The engine is scripted (no app, no model)."""

import asyncio
import dataclasses
import io
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.contract import GenerateResult
from sdxl_engine.engine.steps import StepEvent, Stopped
from sdxl_engine.engine.validation import InvalidRequest, Limits
from sdxl_engine.service.service import Service
from sdxl_engine.serving.apis import core
from sdxl_engine.serving.apis.core import Interrupted, request_of

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                default_guidance=5.0, multiple=16, default_sampler="Euler")
OWNER = "10.1.2.3"


class RouteRequest:
    """The parts of a route's Starlette request core.generate reads: its client, headers and connection."""

    def __init__(self, host: str = "10.1.2.3"):
        self.client, self.headers = SimpleNamespace(host=host), {}

    async def is_disconnected(self) -> bool:
        return False


class ScriptedEngine:
    """The engine contract's generate: call k runs ``script[k](service, job)`` after its third step (it may
    interrupt or skip, as A1111's routes do), then stops if asked, else makes 4 images of its seeds (pixel =
    seed % 256). ``calls``: (seed, the request object) of each call, in order."""

    limits, batch, error = LIMITS, 4, None

    def __init__(self, script):
        self.ready = threading.Event()
        self.ready.set()
        self.script, self.calls, self.service = script, [], None

    def generate(self, request, ready_timeout=None, progress=None, arrived=None, on_step=None, should_stop=None):
        self.calls.append((request.seed, request))
        job = next(j for j in self.service.jobs(None) if j.status == "running")
        for step in range(1, 9):
            on_step(StepEvent(step, 8))
            if step == 3:
                self.script[len(self.calls) - 1](self.service, job)
                if should_stop():
                    raise Stopped("stopped after step 3 of 8")
        seeds = [(request.seed + i) % (LIMITS.max_seed + 1) for i in range(4)]
        images = np.stack([np.full((64, 64, 3), s % 256, np.uint8) for s in seeds])
        return GenerateResult(images, seeds, request, {"latency": 0.1}, [], 4, "4 x cpu", "scripted")


def scripted_service(script, limit: int = 2) -> tuple[Service, list]:
    engine = ScriptedEngine(script)
    engine.service = Service(engine, slots=1, limit=limit)
    return engine.service, engine.calls


def interrupt(service, job):
    service.stop(job)


def skip(service, job):
    service.skip(job)


def run(service, call, host="10.1.2.3"):
    return asyncio.run(core.generate(service, RouteRequest(host), call, "a1111", host))


def nothing(service, job):
    pass


def test_every_call_of_a_request_runs_in_its_one_job(tmp_path):
    service, calls = scripted_service([nothing] * 4)
    made = run(service, request_of(prompt="a red circle", seed=10, images=10))
    assert [c[0] for c in calls] == [10, 14, 18]
    assert made.seeds == list(range(10, 20)) and made.stopped is None  # the last call's first 2 images
    # each image's PNG is the one its call made for its seed, in order
    assert [int(np.asarray(Image.open(io.BytesIO(png)))[0, 0, 0]) for png in made.pngs] == made.seeds
    assert [job.status for job in service.jobs(OWNER)] == ["succeeded"]  # one job for the whole request
    assert service.held("10.1.2.3") == 0 and service.idle()  # its place given back


def test_the_first_call_runs_the_checked_request_and_nothing_validates_it_again(tmp_path):
    """check builds the request as the page does (the style applied, the client's address) and validates it; the
    first engine call gets that object, which validate hands back as it is (validated once); the next calls, of
    other seeds, get a copy with their seed, validated by the service."""
    from sdxl_engine.engine.validation import validate

    service, calls = scripted_service([nothing] * 2)
    run(service, request_of(prompt="a red circle", seed=10, images=8, style="Cinematic", num_inference_steps=3))
    first = calls[0][1]
    assert first.seed == 10 and first.num_inference_steps == 3 and first.client == "10.1.2.3"
    assert first.prompt.startswith("cinematic still a red circle") and first.validated_for == LIMITS
    assert validate(first, LIMITS) is first and calls[1][1].seed == 14
    changed = dataclasses.replace(first, num_inference_steps=500)  # a changed copy is not validated: refused
    with pytest.raises(InvalidRequest, match="^num_inference_steps: "):
        validate(changed, LIMITS)
    other = dataclasses.replace(LIMITS, max_steps=2)  # validated for other limits: validated for these
    with pytest.raises(InvalidRequest, match="^num_inference_steps: "):
        validate(first, other)


def test_an_interrupt_in_a_later_call_answers_the_finished_calls_images(tmp_path):
    service, calls = scripted_service([nothing, interrupt, nothing, nothing])
    made = run(service, request_of(prompt="a red circle", seed=10, images=16))
    assert len(calls) == 2  # no call after the interrupt
    assert made.seeds == [10, 11, 12, 13] and len(made.pngs) == 4
    assert made.stopped == "the request was stopped after step 3 of 8" and made.info["seeds"] == [10, 11, 12, 13]


def test_a_skip_drops_the_running_call_only_and_the_seeds_follow_on(tmp_path):
    service, calls = scripted_service([nothing, skip, nothing])
    made = run(service, request_of(prompt="a red circle", seed=10, images=12))
    assert [c[0] for c in calls] == [10, 14, 18]
    assert made.seeds == [10, 11, 12, 13, 18, 19, 20, 21] and made.stopped.startswith("the request was stopped")


def test_an_interrupt_before_any_image_is_interrupted(tmp_path):
    service, _ = scripted_service([interrupt] + [nothing] * 3)
    with pytest.raises(Interrupted, match="^the request was stopped after step 3 of 8$"):
        run(service, request_of(prompt="a red circle", seed=10, images=16))
    assert [job.status for job in service.jobs(OWNER)] == ["cancelled"]


def test_another_owners_stop_reaches_nothing(tmp_path):
    """A1111's /interrupt stops the caller's own jobs only: the service finds none of this owner's for another."""
    def other(service, job):
        for theirs in service.jobs("10.9.9.9"):
            service.stop(theirs)

    service, _ = scripted_service([other, nothing])
    made = run(service, request_of(prompt="a red circle", seed=1, images=8))
    assert made.seeds == list(range(1, 9)) and made.stopped is None


def test_the_engines_typed_error_reaches_the_protocol_as_its_status(tmp_path):
    """Not by its message: a refusal the engine makes only at run time (a sampler the model's scheduler rules
    out, a new size while others compile) keeps its type through the service, whatever its text says."""
    from sdxl_engine.engine.errors import CompilesBusy, ModelUnavailable

    busy = "width/height: 2 new sizes compile already"
    broken = "model 'b' could not be loaded: its files changed"
    for error, status, message in (
            (InvalidRequest("sampler", "DDIM cannot run this model"), 400, "sampler_name: DDIM cannot run this model"),
            (CompilesBusy(busy), 429, busy), (ModelUnavailable(broken), 503, broken),
            (RuntimeError("the request was stopped, it says"), 500, None)):
        def fail(service, job, error=error):
            raise error

        service, _ = scripted_service([fail])
        with pytest.raises(core.ApiError) as err:
            run(service, request_of((("sampler", "sampler_name"),), prompt="a red circle", seed=1))
        assert err.value.status == status and not isinstance(err.value, Interrupted)
        assert err.value.message == (message or "the engine failed on this request (RuntimeError); it is logged on "
                                                "the server. Please retry.")
        assert service.held("10.1.2.3") == 0


def test_a_client_over_its_limit_or_a_closing_server_is_refused_before_anything_runs(tmp_path):
    """The service's admission: the client's requests from every front count together (the page's two, one
    running and one in line, here); during a shutdown every request is refused with 503."""
    from sdxl_engine.service.request import to_request

    release = threading.Event()
    service, calls = scripted_service([lambda service, job: release.wait(10)] + [nothing] * 4, limit=2)
    held = [service.submit(to_request(prompt="x", seed=100), owner="10.1.2.3", front="page")
            for _ in range(2)]
    deadline = time.monotonic() + 30
    while not calls:  # the first is running (held by the script), the second waits in line
        assert time.monotonic() < deadline and all(job.status != "failed" for job in held), [j.error for j in held]
        threading.Event().wait(0.01)
    try:
        with pytest.raises(core.ApiError) as over:
            run(service, request_of(prompt="a red circle", seed=1))
        assert over.value.status == 429 and "max_requests_per_client = 2" in over.value.message
        assert over.value.headers == {"Retry-After": "5"} and [seed for seed, _ in calls] == [100]
    finally:
        release.set()
    other = run(service, request_of(prompt="a red circle", seed=1), host="10.7.7.7")  # another address: served
    assert other.seeds == [1, 2, 3, 4]
    assert all(job.status == "succeeded" for job in held)
    service.close()
    with pytest.raises(core.ApiError) as closing:
        run(service, request_of(prompt="a red circle", seed=1), host="10.7.7.7")
    assert closing.value.status == 503 and closing.value.message == "the server is shutting down; retry in a minute"


def test_a_client_that_leaves_during_a_call_gets_no_further_calls(tmp_path):
    """A request of 12 images whose client disconnects while its first engine call runs: that call stops after
    its running step, no other runs (the engine makes no images for no one), and the job ends cancelled."""
    gone = threading.Event()

    def leave(service, job):
        gone.set()  # the client leaves while this call runs
        deadline = 10.0
        while not job.cancelled.is_set() and deadline > 0:  # until the route has noticed
            threading.Event().wait(0.05)
            deadline -= 0.05

    service, calls = scripted_service([leave, nothing, nothing])
    request = RouteRequest()

    async def is_disconnected() -> bool:
        return gone.is_set()

    request.is_disconnected = is_disconnected
    with pytest.raises(Interrupted):
        asked = request_of(prompt="a red circle", seed=10, images=12)
        asyncio.run(core.generate(service, request, asked, "a1111", OWNER))
    assert [c[0] for c in calls] == [10] and [job.status for job in service.jobs(OWNER)] == ["cancelled"]
