"""serving/apis/core.generate as one job of its owner: a request of several engine calls keeps the images
its finished calls made when it is interrupted, a skip drops only the running call, and the job's id
reaches every queued call. The queue is replaced by a scripted one (no app, no engine)."""

import asyncio
import io
import threading

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.steps import Stopped
from sdxl_engine.engine.validation import InvalidRequest, Limits
from sdxl_engine.serving.apis import core
from sdxl_engine.serving.apis.core import Call, Interrupted
from sdxl_engine.serving.images import png_bytes
from sdxl_engine.serving.progress import JOB_SCOPE_KEY, JOBS

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                default_guidance=5.0, multiple=16, default_sampler="Euler")
OWNER = ("a1111", "10.1.2.3")


class Engine:
    limits, batch, error = LIMITS, 4, None

    def __init__(self):
        self.ready = threading.Event()
        self.ready.set()


def scripted_queue(monkeypatch, tmp_path, script):
    """Replace the queue: call k begins as the handler begins it, runs ``script[k](job)`` (it may interrupt or skip), then answers the
    /generate event's outputs for the seeds it was asked for, or the handler's stop message if the job's
    call was stopped. Returns the calls' (seed, job id, continues) as they came."""
    calls = []

    async def run_queued(demo, api_name, values, request, scope=None):
        job, seed = scope[JOB_SCOPE_KEY], values[2]
        calls.append((seed, job, bool(scope.get("sdxl_engine.continues"))))
        JOBS.begin_call(job, 8)  # as handler.handle_generate does
        script[len(calls) - 1](job)
        if JOBS.stop_requested(job):  # as handler.handle_generate answers a stopped call
            JOBS.fail(job, Stopped("stopped after step 3 of 8"))
            return False, {"error": "the request was stopped after step 3 of 8"}
        gallery, pngs = [], []
        for i in range(4):
            path = tmp_path / f"call{len(calls)}-{i}.png"
            pngs.append(png_bytes(np.full((2, 2, 3), seed + i, np.uint8)))
            path.write_bytes(b"the served file: an answer takes the bytes from memory, not from here")
            gallery.append({"image": {"path": str(path)}, "caption": ""})
        JOBS.deliver(job, pngs)  # as handler.handle_generate hands its PNGs to the job
        return True, {"data": [gallery, {"seeds": [seed + i for i in range(4)], "width": 64, "height": 64}]}

    monkeypatch.setattr(core.gradio_internals, "run_queued", run_queued)
    return calls


def run(call):
    return asyncio.run(core.generate(None, Engine(), None, call, OWNER))


def nothing(job):
    pass


def test_every_call_of_a_request_carries_its_one_job_and_the_job_closes(monkeypatch, tmp_path):
    calls = scripted_queue(monkeypatch, tmp_path, [nothing] * 4)
    made = run(Call("a red circle", seed=10, images=10))
    assert [c[0] for c in calls] == [10, 14, 18] and [c[2] for c in calls] == [False, True, True]
    assert len({c[1] for c in calls}) == 1 and made.seeds == list(range(10, 20)) and made.stopped is None
    # each image's PNG is the one its call delivered for its seed, in order (progress.Jobs.take_pngs)
    assert [int(np.asarray(Image.open(io.BytesIO(png)))[0, 0, 0]) for png in made.pngs] == made.seeds
    assert JOBS.snapshot(OWNER).job is None  # closed


def test_an_interrupt_in_a_later_call_answers_the_finished_calls_images(monkeypatch, tmp_path):
    calls = scripted_queue(monkeypatch, tmp_path, [nothing, lambda job: JOBS.interrupt(OWNER), nothing, nothing])
    made = run(Call("a red circle", seed=10, images=16))
    assert len(calls) == 2  # no call after the interrupt
    assert made.seeds == [10, 11, 12, 13] and len(made.pngs) == 4
    assert made.stopped == "the request was stopped after step 3 of 8" and made.info["seeds"] == [10, 11, 12, 13]


def test_a_skip_drops_the_running_call_only_and_the_seeds_follow_on(monkeypatch, tmp_path):
    calls = scripted_queue(monkeypatch, tmp_path, [nothing, lambda job: JOBS.skip(OWNER), nothing])
    made = run(Call("a red circle", seed=10, images=12))
    assert [c[0] for c in calls] == [10, 14, 18]
    assert made.seeds == [10, 11, 12, 13, 18, 19, 20, 21] and made.stopped.startswith("the request was stopped")


def test_an_interrupt_before_any_image_is_interrupted(monkeypatch, tmp_path):
    scripted_queue(monkeypatch, tmp_path, [lambda job: JOBS.interrupt(OWNER)] + [nothing] * 3)
    with pytest.raises(Interrupted, match="^the request was stopped after step 3 of 8$"):
        run(Call("a red circle", seed=10, images=16))
    assert JOBS.snapshot(OWNER).job is None


def test_another_clients_interrupt_stops_nothing(monkeypatch, tmp_path):
    scripted_queue(monkeypatch, tmp_path, [lambda job: JOBS.interrupt(("a1111", "10.9.9.9")),
                                           lambda job: JOBS.interrupt(("gradio", "x"))])
    made = run(Call("a red circle", seed=1, images=8))
    assert made.seeds == list(range(1, 9)) and made.stopped is None


def test_the_handlers_typed_error_crosses_the_queue_as_the_protocols_status(monkeypatch, tmp_path):
    """Not by its message: a refusal the engine makes only at run time (a sampler the model's scheduler rules
    out, a new size while others compile) keeps its type on the job, whatever its text says."""
    from sdxl_engine.engine.errors import CompilesBusy

    for error, status in ((InvalidRequest("sampler", "DDIM cannot run this model"), 400),
                          (CompilesBusy("width/height: 2 new sizes compile already"), 429),
                          (RuntimeError("the request was stopped, it says"), 500)):
        async def run_queued(demo, api_name, values, request, scope=None, error=error):
            JOBS.begin_call(scope[JOB_SCOPE_KEY], 8)
            JOBS.fail(scope[JOB_SCOPE_KEY], error)
            return False, {"error": str(error)}

        monkeypatch.setattr(core.gradio_internals, "run_queued", run_queued)
        with pytest.raises(core.ApiError) as err:
            run(Call("a red circle", seed=1))
        assert err.value.status == status and not isinstance(err.value, Interrupted) and err.value.message == str(error)


def test_the_handlers_page_escaped_message_reaches_an_api_client_as_text(monkeypatch):
    """The handler's refusals are HTML-escaped for the page's pop-up (handler.shown); the protocol APIs answer
    the text itself, with the real < > & a client can copy back."""
    from sdxl_engine.serving.handler import shown

    message = "prompt: '<lora:x:9>': the weight must be between -4 and 4 & more"

    async def run_queued(demo, api_name, values, request, scope=None):
        return False, {"error": shown(message)}

    monkeypatch.setattr(core.gradio_internals, "run_queued", run_queued)
    with pytest.raises(core.ApiError) as caught:
        run(Call("a red circle", seed=10, images=4))
    assert caught.value.status == 500 and caught.value.message == message
