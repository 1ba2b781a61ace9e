"""The page's events as clients of the service (handler.follow, api_function, image_function, upscale_function):
each submits a job and follows it; previews stream, nothing before the first; the per-client cap holds across the
page's events; a Stop (Gradio cancelling the event's task) takes a waiting job out of the line and stops a running
one within a step; the service's refusals and typed errors become gr.Error.

The engine is tests/service's stand-in whose steps wait for the test (StepEngine), so the order is the test's."""

import asyncio
import dataclasses
import time
import types

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from sdxl_engine.config import EngineConfig
from sdxl_engine.service.jobs import CANCELLED, QUEUED, RUNNING, SUCCEEDED
from sdxl_engine.service.service import SHUTTING_DOWN, Service, over_limit_message
from sdxl_engine.serving import handler, history
from tests.helpers import StepEngine


def wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)

CONFIG = EngineConfig.load(environ={})


class PageEngine(StepEngine):
    """StepEngine with what the page's progress reads of an engine (stage, start time, device summary)."""

    stage, started, startup, device_summary = "ready", 0.0, {}, "1 x cpu"


def caller(address: str = "10.0.0.5", session: str = "s1"):
    """What the events read of a gr.Request: the peer's address (the owner), headers, the session."""
    return types.SimpleNamespace(client=types.SimpleNamespace(host=address), headers={}, session_hash=session)


@pytest.fixture
def fake():
    return PageEngine()


@pytest.fixture
def page(fake, tmp_path, monkeypatch):
    """(the service, its /generate function, the history's pending records); Gradio's upload folder in tmp_path."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    requests = Service(fake, slots=1, limit=2)
    pending = history.Pending()
    yield requests, handler.api_function(requests, CONFIG, pending), pending
    requests.close()
    fake.go(1000)


def generate(function, prompt="a red circle", address="10.0.0.5", session="s1", steps=2, progress=None, **kwargs):
    """One /generate call's async generator, as Gradio runs it."""
    return function(prompt, "", 3, 5.0, steps, 48, 32, request=caller(address, session),
                    progress=progress or (lambda *a, **k: None), **kwargs)


async def collect(stream, outs: list):
    async for out in stream:
        outs.append(out)


def test_previews_stream_after_the_first_step_then_the_images_and_the_record(fake, page):
    requests, function, pending = page
    reports = []

    async def main():
        outs = []
        task = asyncio.ensure_future(collect(generate(function, progress=lambda *a, **k: reports.append((a, k))),
                                             outs))
        await asyncio.sleep(0.3)
        assert outs == [] and not task.done()  # nothing yielded before the first step: the progress line stays
        fake.go(1)
        await asyncio.to_thread(wait_for, lambda: len(outs) == 1)
        fake.go(1)
        await asyncio.wait_for(task, 10)
        return outs

    outs = asyncio.run(main())
    previews, (gallery, info) = outs[:-1], outs[-1]
    assert [caption for shown, _ in previews for _, caption in shown] == ["preview · step 1/2", "preview · step 2/2"]
    assert all(out[1] is None for out in previews)
    assert [caption.split(" · ")[0] for _, caption in gallery] == ["seed 3", "seed 4"]
    assert info["seeds"] == [3, 4] and info["style"] == "(No style)"
    for path, seed in zip((p for p, _ in gallery), (3, 4)):
        with Image.open(path) as png:  # the service's PNG bytes, written where Gradio serves them
            assert np.asarray(png.convert("RGB")).max() == seed and "Seed: " in png.text["parameters"]
    assert pending.pop("s1")["seeds"] == [3, 4]
    steps = [a[0] for a, k in reports if k.get("unit") == "steps"]
    assert steps == [(1, 2), (2, 2)]
    assert [k["desc"] for a, k in reports if k.get("unit") != "steps"][-1] == "Encoding PNGs"


def image_events(fake, requests, pending, tmp_path, monkeypatch):
    """The page's image to image and upscale functions on ``requests``, with a 48x32 picture the guard let through:
    (img2img, upscale, the editor's value naming it, a last result holding it with seed 3)."""
    monkeypatch.setattr(fake, "limits", dataclasses.replace(fake.limits, sizes=((48, 32), (64, 64), (72, 48))))
    image = tmp_path / "picture.png"
    Image.new("RGB", (48, 32), (200, 10, 10)).save(image)
    monkeypatch.setattr(handler, "readable", lambda demo, path: True)
    monkeypatch.setattr(handler, "discard_uploads", lambda *a, **k: None)
    img2img = handler.image_function(requests, CONFIG, pending, None, demo=None)
    upscale = handler.upscale_function(requests, CONFIG, pending, None, demo=None)
    editor = {"background": {"path": str(image)}, "layers": [], "composite": {"path": str(image)}}
    return img2img, upscale, editor, {"gallery": [[str(image), "seed 3"]], "info": {"seeds": [3]}}


def test_the_cap_holds_across_the_pages_events(fake, page, tmp_path, monkeypatch):
    """A client with max_requests_per_client requests running from /generate is refused on image to image and
    upscale too (the service's message as the page's error); another address is not."""
    requests, function, pending = page
    img2img, upscale, editor, last = image_events(fake, requests, pending, tmp_path, monkeypatch)

    async def main():
        held = [asyncio.ensure_future(collect(generate(function, session=f"s{i}"), [])) for i in range(2)]
        await asyncio.sleep(0.1)
        assert requests.held("10.0.0.5") == 2
        refusals = []
        for stream in (img2img("a red circle", "", 3, 5.0, 2, 48, 32, image=editor, request=caller(),
                               progress=lambda *a, **k: None),
                       upscale("a red circle", "", 3, 5.0, 2, 0, 0, last=last, index=0, request=caller(),
                               progress=lambda *a, **k: None)):
            with pytest.raises(gr.Error) as refused:
                await collect(stream, [])
            refusals.append(refused.value.message)
        other = asyncio.ensure_future(collect(generate(function, address="10.0.0.6"), []))
        await asyncio.sleep(0.1)
        assert requests.held("10.0.0.6") == 1  # another client's place
        fake.go(1000)
        await asyncio.wait_for(asyncio.gather(*held, other), 10)
        return refusals

    assert asyncio.run(main()) == [handler.shown(over_limit_message(2))] * 2


def test_one_address_is_one_client_whatever_session_hashes_it_sends(fake, page):
    requests, function, _ = page

    async def main():
        held = [asyncio.ensure_future(collect(generate(function, session=f"made-up-{i}"), [])) for i in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(gr.Error, match="too many requests from this client"):
            await collect(generate(function, session="made-up-2"), [])
        fake.go(1000)
        await asyncio.wait_for(asyncio.gather(*held), 10)

    asyncio.run(main())


def test_a_stop_while_the_request_waits_takes_it_out_of_the_line_and_it_never_runs(fake, page):
    requests, function, _ = page

    async def main():
        first = asyncio.ensure_future(collect(generate(function, address="10.0.0.1"), []))
        await asyncio.sleep(0.1)
        waiting = asyncio.ensure_future(collect(generate(function, prompt="a blue square"), []))
        await asyncio.sleep(0.1)
        job = requests.jobs("10.0.0.5")[0]
        assert job.status == QUEUED and requests.waiting == 1
        waiting.cancel()  # the page's Stop: Gradio cancels the event's task
        await asyncio.gather(waiting, return_exceptions=True)
        assert job.status == CANCELLED and requests.waiting == 0 and requests.held("10.0.0.5") == 0
        fake.go(1000)
        await asyncio.wait_for(first, 10)
        return job

    job = asyncio.run(main())
    assert [call.prompt for call in fake.calls] == ["a red circle"]  # the stopped one never reached the engine
    assert job.result is None


def test_a_stop_while_the_request_runs_stops_it_within_a_step_and_the_next_one_runs(fake, page):
    requests, function, _ = page

    async def main():
        running = asyncio.ensure_future(collect(generate(function, steps=20), []))
        await asyncio.sleep(0.1)
        job = requests.jobs("10.0.0.5")[0]
        fake.go(1)
        await asyncio.to_thread(wait_for, lambda: job.step == 1)
        assert job.status == RUNNING
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await asyncio.to_thread(wait_for, lambda: job.done)
        assert job.status == CANCELLED and fake.steps_seen == 1  # no step after the Stop
        outs = []
        fake.go(2)
        await asyncio.wait_for(collect(generate(function, prompt="next"), outs), 10)
        return outs[-1]

    gallery, info = asyncio.run(main())
    assert info["seeds"] == [3, 4] and len(gallery) == 2


def test_a_stop_reaches_a_running_job_whose_event_gradio_lost(fake, tmp_path, monkeypatch, runtime_log):
    """The page's Stop, once its cancel is through (PageJobs.stop_left, the failed event's follow-up): a job whose
    follow() Gradio neither cancelled nor closed (a generator it lost between two steps) is stopped within a step,
    with one log line; a failure without a Stop ("" heard) stops nothing, nor does another session's Stop; a job
    leaves the session's list when its follow() ends."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    requests = Service(fake, slots=1, limit=2)
    following = handler.PageJobs(requests)
    function = handler.api_function(requests, CONFIG, history.Pending(), following=following)
    try:
        async def main():
            stream = generate(function, steps=20)
            started = asyncio.ensure_future(stream.__anext__())  # runs follow() up to its first yield
            await asyncio.to_thread(wait_for, lambda: len(following.running("s1")) == 1)
            job = following.running("s1")[0]
            fake.go(1)
            await asyncio.wait_for(started, 10)  # the first preview: follow() now waits at its yield, never resumed
            assert job.status == RUNNING and following.running("s2") == []
            following.stop_left("", caller(session="s1"))  # an error, not a Stop
            following.stop_left("1/20", caller(session="s2"))  # another browser's Stop
            fake.go(1)
            await asyncio.to_thread(wait_for, lambda: job.step == 2)
            assert not job.cancelled.is_set() and job.status == RUNNING
            following.stop_left("2/20", caller(session="s1"))
            fake.go(1)
            await asyncio.to_thread(wait_for, lambda: job.done)
            assert job.status == CANCELLED and fake.steps_seen <= 3 and following.running("s1") == []
            await stream.aclose()
            fake.go(2)
            outs = []
            await asyncio.wait_for(collect(generate(function, prompt="next"), outs), 10)
            return outs[-1]

        gallery, info = asyncio.run(main())
        assert len(gallery) == 2 and following._jobs == {"s1": set()}  # the finished follow() took its job out
        assert [line for line in runtime_log if "after its Stop" in line] == [
            "[app] a page request still ran after its Stop: stopping it (running)"]
    finally:
        requests.close()
        fake.go(1000)


def test_refusals_and_typed_errors_are_the_pages_errors(fake, page, runtime_log):
    requests, function, _ = page

    async def run(**kwargs):
        await collect(generate(function, **kwargs), [])

    with pytest.raises(gr.Error, match="prompt: is empty"):
        asyncio.run(run(prompt="  "))
    assert runtime_log[-1].startswith("[app] request refused: prompt: is empty")
    with pytest.raises(gr.Error) as styled:
        asyncio.run(run(style="Baroque"))
    assert styled.value.message.startswith("style: unknown style 'Baroque'")
    with pytest.raises(gr.Error) as tagged:  # the pop-up renders HTML: what the client sent is text there
        asyncio.run(run(style="<b>x</b>"))
    assert "&lt;b&gt;x&lt;/b&gt;" in tagged.value.message and "<b>" not in tagged.value.message
    requests.close()
    with pytest.raises(gr.Error, match=SHUTTING_DOWN.split(";")[0]):
        asyncio.run(run())


def test_the_engines_warnings_are_the_pages_and_a_style_is_named_beside_those_on_the_prompts(fake, page,
                                                                                            monkeypatch):
    requests, function, _ = page
    generate_images = fake.generate

    def warned(request, **kwargs):
        result = generate_images(request, **kwargs)
        return dataclasses.replace(result, warnings=["negative prompt: a weight beyond ±10 was clamped to ±10"])

    monkeypatch.setattr(fake, "generate", warned)
    shown = []
    monkeypatch.setattr(handler.gr, "Warning", shown.append)
    fake.go(1000)
    asyncio.run(collect(generate(function, style="Anime"), []))
    asyncio.run(collect(generate(function), []))
    assert shown == ["negative prompt: a weight beyond ±10 was clamped to ±10 (the Anime style adds words around "
                     "yours)", "negative prompt: a weight beyond ±10 was clamped to ±10"]


def test_a_job_that_fails_in_the_engine_is_one_message_without_internals(fake, page, monkeypatch):
    requests, function, _ = page

    def broken(*args, **kwargs):
        raise KeyError("internal detail")

    monkeypatch.setattr(fake, "generate", broken)

    async def main():
        await collect(generate(function), [])

    with pytest.raises(gr.Error) as failed:
        asyncio.run(main())
    assert failed.value.message.startswith("the engine failed on this request (KeyError)")
    assert "internal detail" not in failed.value.message
    assert requests.jobs("10.0.0.5")[0].status not in (SUCCEEDED, QUEUED)


def test_the_image_events_run_the_pages_schedule_type(fake, page, tmp_path, monkeypatch):
    """Generate from image and Upscale take the Schedule type dropdown's value (its A1111 label) as /generate does,
    and the engine runs it; none is automatic."""
    requests, _, pending = page
    img2img, upscale, editor, last = image_events(fake, requests, pending, tmp_path, monkeypatch)
    quiet = dict(request=caller(), progress=lambda *a, **k: None)
    fake.go(1000)
    for stream in (img2img("a red circle", "", 3, 5.0, 2, 48, 32, image=editor, schedule_type="Karras", **quiet),
                   upscale("a red circle", "", 3, 5.0, 2, 0, 0, last=last, index=0, schedule_type="SGM Uniform",
                           **quiet),
                   img2img("a red circle", "", 3, 5.0, 2, 48, 32, image=editor, **quiet)):
        asyncio.run(collect(stream, []))
    assert [call.schedule_type for call in fake.calls] == ["karras", "sgm_uniform", "automatic"]
    assert fake.calls[1].hires_scale == 1.5  # the upscale event's request
