"""serving/service.py: the slots every generation takes in order of arrival, the protocols' admission and the
request service's calls (no app, no engine: the handler is a stand-in)."""

import asyncio
import threading
import time

import pytest

from sdxl_engine.engine.steps import Stopped
from sdxl_engine.serving.guard import RequestGate
from sdxl_engine.serving.progress import JOBS
from sdxl_engine.serving.service import Failed, Refused, RequestService, Slots


def wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_slots_are_given_in_order_of_arrival_n_at_a_time():
    slots = Slots(2, poll_s=0.01)
    slots.take()
    slots.take()  # both slots taken: the callers below wait
    order, threads = [], []
    for name in "abcd":
        thread = threading.Thread(target=lambda name=name: (slots.take(), order.append(name)), daemon=True)
        thread.start()
        threads.append(thread)
        wait_for(lambda: slots.waiting == len(threads))  # in line before the next one arrives
    assert order == [] and slots.taken == 2
    slots.give()
    wait_for(lambda: order == ["a"])
    slots.give()
    slots.give()
    wait_for(lambda: order == ["a", "b", "c"])
    assert slots.taken == 2 and slots.waiting == 1
    slots.give()
    for thread in threads:
        thread.join(5)
    assert order == ["a", "b", "c", "d"] and slots.waiting == 0


def test_a_caller_stopped_while_it_waits_leaves_the_line_and_the_next_moves_up():
    slots = Slots(1, poll_s=0.01)
    slots.take()
    stop, waited, outcome = threading.Event(), [], {}

    def first():
        try:
            slots.take(stop.is_set, lambda: waited.append("first"))
        except Stopped as err:
            outcome["first"] = str(err)

    def second():
        slots.take()
        outcome["second"] = "ran"

    a = threading.Thread(target=first, daemon=True)
    a.start()
    wait_for(lambda: slots.waiting == 1)
    b = threading.Thread(target=second, daemon=True)
    b.start()
    wait_for(lambda: slots.waiting == 2)
    stop.set()
    a.join(5)
    assert outcome == {"first": "stopped before it started"} and waited == ["first"] and slots.waiting == 1
    slots.give()
    b.join(5)
    assert outcome["second"] == "ran" and slots.taken == 1
    with pytest.raises(ValueError, match="at least one slot"):
        Slots(0)


def test_a_free_slot_is_taken_at_once_without_a_wait():
    slots, waited = Slots(1), []
    with slots.held(on_wait=lambda: waited.append(1)):
        assert slots.taken == 1
    assert slots.taken == 0 and waited == []


def service_with(handle, slots: int = 1, limit: int = 2) -> RequestService:
    return RequestService(object(), handle, RequestGate(), slots=slots, limit=limit, log=lambda line: None)


def test_the_service_runs_gradio_calls_in_its_slots_counted_by_the_gate():
    seen = {}

    def handle(engine, *values, slots, **kwargs):
        seen.update(values=values, slots=slots, in_flight=service.gate.in_flight, **kwargs)
        return "made"

    service = service_with(handle)
    assert service.generate("a red circle", 5, job="j") == "made"
    assert seen["slots"] is service.slots and seen["values"] == ("a red circle", 5) and seen["job"] == "j"
    assert seen["in_flight"] == 1 and service.gate.in_flight == 0


def test_two_protocol_requests_run_at_once_with_two_slots_each_with_its_own_job():
    """With two slots (--replicas 2) two requests are on the engine together; each call carries its own job id,
    and each request's PNGs are its own."""
    both_in, release = threading.Barrier(2, timeout=10), threading.Event()

    def handle(engine, *values, job, **kwargs):
        assert service.slots.taken == 2 or not both_in.broken
        both_in.wait()  # both calls hold a slot at the same time, or this times out
        release.wait(10)
        JOBS.deliver(job, [job.encode()])
        return [(f"/{job}.png", "")], {"seeds": [values[2]]}, {}

    service = service_with(handle, slots=2)

    async def two():
        jobs = [JOBS.open(("a1111", f"10.0.0.{i}")) for i in (1, 2)]
        runs = [asyncio.ensure_future(service.run(("p", "", seed), job=job, client=f"10.0.0.{seed}"))
                for seed, job in zip((1, 2), jobs)]
        await asyncio.sleep(0.2)
        release.set()
        made = await asyncio.gather(*runs)
        for job in jobs:
            JOBS.close(job)
        return jobs, made

    jobs, made = asyncio.run(two())
    assert [m.pngs for m in made] == [[jobs[0].encode()], [jobs[1].encode()]]
    assert [m.info["seeds"] for m in made] == [[1], [2]] and service.slots.taken == 0


def test_a_protocol_request_whose_client_left_while_it_waited_does_not_run():
    ran, lines = [], []

    def handle(engine, *values, **kwargs):
        ran.append(values[0])
        return [], {"seeds": []}, {}

    service = service_with(handle)
    service.log = lines.append
    service.slots.take()  # the request ahead holds the only slot

    async def client_leaves():
        gone = asyncio.Event()

        async def left():
            return gone.is_set()

        job = JOBS.open(("openai", "10.0.0.1"))
        run = asyncio.ensure_future(service.run(("p", "", 1), job=job, client="10.0.0.1", left=left))
        await asyncio.sleep(0.3)
        assert service.slots.waiting == 1 and service.gate.in_flight == 1  # waiting, counted for the drain
        gone.set()
        try:
            await run
        finally:
            JOBS.close(job)

    with pytest.raises(Failed) as failed:
        asyncio.run(client_leaves())
    assert failed.value.stopped and failed.value.message == "the request was stopped before it started"
    assert ran == [] and service.slots.waiting == 0 and service.gate.in_flight == 0
    assert lines == ["[app] request stopped before it started (its client left); nothing saved"]


def test_an_interrupt_while_a_protocol_request_waits_ends_it_and_a_waiting_thread_moves_up():
    """A coroutine and a thread wait in one line: the interrupted coroutine leaves it, the thread behind it
    gets the slot when the one ahead gives it back."""
    service = service_with(lambda *a, **k: ([], {"seeds": []}, {}))
    service.slots.poll_s = 0.01
    service.slots.take()
    owner = ("a1111", "10.0.0.3")
    order = []

    async def scenario():
        job = JOBS.open(owner)
        run = asyncio.ensure_future(service.run(("p", "", 1), job=job, client="10.0.0.3"))
        await asyncio.sleep(0.05)
        thread = threading.Thread(target=lambda: (service.slots.take(), order.append("thread")), daemon=True)
        thread.start()
        await asyncio.to_thread(wait_for, lambda: service.slots.waiting == 2)
        JOBS.interrupt(owner)
        try:
            await run
        except Failed as err:
            order.append(err.message)
        finally:
            JOBS.close(job)
        service.slots.give()
        await asyncio.to_thread(thread.join, 5)

    asyncio.run(scenario())
    assert order == ["the request was stopped before it started", "thread"] and service.slots.taken == 1


def test_admission_counts_a_clients_protocol_requests_and_gives_the_place_back():
    service = service_with(lambda *a, **k: None, limit=2)
    with service.admitted("10.0.0.1"):
        with service.admitted("10.0.0.1"):
            assert service.held("10.0.0.1") == 2
            with pytest.raises(Refused) as over:
                with service.admitted("10.0.0.1"):
                    pass
            with service.admitted("10.0.0.2"):  # another client has its own count
                pass
        assert service.held("10.0.0.1") == 1
    assert over.value.status == 429 and over.value.retry_after_s == 5 and service.held("10.0.0.1") == 0
    with pytest.raises(ValueError, match="limit must be at least 1"):
        service_with(lambda *a, **k: None, limit=0)


def test_the_handler_waits_for_a_slot_says_so_and_leaves_the_line_when_its_job_is_interrupted():
    """handle_generate in the service's slots: while the request ahead holds the only slot the page hears
    "Waiting for the request ahead", and an interrupt of its job while it waits ends it with nothing run."""
    import types

    import gradio as gr

    from sdxl_engine.serving.handler import handle_generate

    calls, heard = [], []
    ready = threading.Event()
    ready.set()
    engine = types.SimpleNamespace(
        ready=ready, limits=types.SimpleNamespace(default_steps=8, default_size=(64, 64), default_sampler="Euler"),
        startup={}, device_summary="4 x cpu", batch=4, generate=lambda request, **kw: calls.append(request))
    slots = Slots(1, poll_s=0.01)
    slots.take()
    owner = ("a1111", "10.0.0.9")
    job = JOBS.open(owner)
    outcome = {}

    def run():
        try:
            handle_generate(engine, "a red circle", "", 1, 5.0, 8, 64, 64, job=job, slots=slots,
                            progress=lambda fraction, desc="", **kw: heard.append(desc))
        except gr.Error as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: slots.waiting == 1)
    assert heard == ["Waiting for the request ahead on the devices"]
    JOBS.interrupt(owner)
    thread.join(10)
    JOBS.close(job)
    assert outcome["error"].message == "the request was stopped before it started"
    assert isinstance(outcome["error"].__cause__, Stopped) and calls == [] and slots.waiting == 0


def test_a_protocol_request_is_refused_when_max_queue_size_requests_wait_already():
    """max_queue_size bounds the protocols' wait too: the requests waiting for a slot and the calls waiting in
    Gradio's queue count together; below the bound a request is admitted, and a free slot means no wait."""
    lines = []
    service = RequestService(object(), lambda *a, **k: None, RequestGate(), slots=1, limit=8, max_waiting=3,
                             log=lines.append)
    with service.admitted("10.0.0.1"):  # nothing waits
        pass
    service.slots.take()
    service.slots._line.extend([object(), object()])  # two callers wait for the slot
    service.gradio_waiting = lambda: 0
    with service.admitted("10.0.0.1"):  # 2 waiting < 3
        pass
    service.gradio_waiting = lambda: 1  # and one call in Gradio's queue: 3
    with pytest.raises(Refused) as full:
        with service.admitted("10.0.0.2"):
            pass
    assert full.value.status == 503 and full.value.retry_after_s == 5
    assert full.value.message == ("the server cannot take this request now: 3 requests wait already "
                                  "(max_queue_size = 3); retry later")
    assert lines == [f"[app] request refused: {full.value.message} (client 10.0.0.2)"] and service.held("10.0.0.2") == 0


def test_a_call_whose_client_has_gone_does_not_run_even_when_a_slot_is_free():
    """The later engine calls of a protocol request whose client left while an earlier one ran: asked before the
    slot is taken, so a free slot does not make images for no one."""
    ran, lines = [], []
    service = service_with(lambda *values, **kwargs: ran.append(values) or ([], {"seeds": []}, {}))
    service.log = lines.append

    async def gone():
        return True

    async def call():
        job = JOBS.open(("openai", "10.0.0.4"))
        try:
            return await service.run(("p", "", 1), job=job, client="10.0.0.4", left=gone)
        finally:
            JOBS.close(job)

    with pytest.raises(Failed) as failed:
        asyncio.run(call())
    assert failed.value.stopped and ran == [] and service.slots.taken == 0 and service.gate.in_flight == 0
    assert lines == ["[app] request stopped before it started (its client left); nothing saved"]


def test_a_protocol_request_whose_client_leaves_while_it_runs_stops_after_the_running_step():
    """A raw A1111 client killed mid-run: its job is cancelled, so the handler's stop check ends the run (the next
    caller does not wait for images no one will read); one line logged."""
    started, stopped, lines = threading.Event(), threading.Event(), []

    def handle(engine, *values, job, **kwargs):
        started.set()
        deadline = time.monotonic() + 10
        while not JOBS.stop_requested(job):  # the engine's step hook asks this at every step
            assert time.monotonic() < deadline, "the run was not stopped"
            time.sleep(0.01)
        stopped.set()
        raise RuntimeError("stopped")

    service = service_with(handle)
    service.log = lines.append

    async def client_leaves_mid_run():
        gone = asyncio.Event()

        async def left():
            return gone.is_set()

        job = JOBS.open(("a1111", "10.0.0.5"))
        run = asyncio.ensure_future(service.run(("p", "", 1), job=job, client="10.0.0.5", left=left))
        while not started.is_set():
            await asyncio.sleep(0.01)
        gone.set()
        try:
            await run
        finally:
            JOBS.close(job)

    with pytest.raises(Failed):
        asyncio.run(client_leaves_mid_run())
    assert stopped.is_set() and service.slots.taken == 0
    assert lines == ["[app] a protocol request's client left while it ran: stopping it after the running step"]
