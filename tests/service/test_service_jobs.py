"""service/service.py and jobs.py: one line for every front, jobs by id and owner, cancel within a step, the cap.

Most tests drive a stand-in engine whose steps wait for the test (:class:`StepEngine`), so the order of events is
the test's; one runs the real tiny engine and compares the images with the engine's own."""

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.service.image_prep import PasteBack
from sdxl_engine.service.jobs import CANCELLED, QUEUED, RUNNING, SUCCEEDED, JobGone, JobNotFound, JobStore
from sdxl_engine.service.request import to_request
from sdxl_engine.service.service import Refused, Service
from tests.helpers import StepEngine


def wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def ask(prompt="a red circle", **fields):
    return to_request(prompt=prompt, seed=fields.pop("seed", 10), num_inference_steps=fields.pop("steps", 2),
                      **fields)


@pytest.fixture
def fake():
    return StepEngine()


@pytest.fixture
def service(fake):
    service = Service(fake, slots=1, limit=2)
    yield service
    service.close()
    fake.go(1000)


def test_a_job_runs_with_events_in_order_and_its_images_as_arrays_and_pngs(fake, service):
    job = service.submit(ask(width=48, height=32), owner="10.0.0.1", front="jobs")
    assert job.status in (QUEUED, RUNNING)
    fake.go(2)
    wait_for(lambda: job.done)
    names = [name for name, _ in job.events()]
    assert names[:2] == ["queued", "started"] and names[-1] == SUCCEEDED
    assert [data["step"] for name, data in job.events() if name == "step"] == [1, 2]
    assert job.result.images.shape == (2, 32, 48, 3) and job.result.seeds == [10, 11]
    assert job.result.images[1, 0, 0, 0] == 11
    assert all(png.startswith(b"\x89PNG") for png in job.result.pngs) and len(job.result.pngs) == 2
    assert job.result.stems[0].startswith("seed10-a-red-circle")


def test_more_images_than_a_batch_run_further_calls_with_the_seeds_following_on(fake, service):
    job = service.submit(ask(images=3), owner="a", front="a1111")
    fake.go(4)
    wait_for(lambda: job.done)
    assert job.status == SUCCEEDED and job.result.seeds == [10, 11, 12] and len(job.result.pngs) == 3
    assert [call.seed for call in fake.calls] == [10, 12]


def test_jobs_run_in_order_of_arrival_and_hear_their_place_in_line(fake, service):
    first = service.submit(ask(), owner="a", front="page")
    wait_for(lambda: first.status == RUNNING)
    second = service.submit(ask(seed=20), owner="b", front="openai")
    third = service.submit(ask(seed=30), owner="c", front="mcp")
    assert (second.position, third.position) == (0, 1)
    fake.go(2)
    wait_for(lambda: first.done and second.status == RUNNING)
    assert third.position == 0 and ("queued", {"position": 0}) in third.events()
    fake.go(4)
    wait_for(lambda: third.done)
    assert [call.seed for call in fake.calls] == [10, 20, 30]


def test_the_cap_counts_a_clients_requests_from_every_front(fake, service):
    service.submit(ask(), owner="10.0.0.1", front="page")
    service.submit(ask(), owner="10.0.0.1", front="mcp")
    with pytest.raises(Refused) as refused:
        service.submit(ask(), owner="10.0.0.1", front="a1111")
    assert refused.value.status == 429 and "max_requests_per_client = 2" in refused.value.message
    other = service.submit(ask(), owner="10.0.0.2", front="a1111")  # another client is not held up by the cap
    fake.go(6)
    wait_for(lambda: other.done)
    assert service.held("10.0.0.1") == 0
    service.submit(ask(), owner="10.0.0.1", front="openai")  # a place again once the earlier ones finished


def test_the_cap_counts_by_client_address_whatever_the_owner(fake, service):
    """With an API key every holder of it is one owner, but the cap is each client address's: two owners from one
    address share its places, and one owner from two addresses has two sets."""
    service.submit(ask(), owner="key-a", front="jobs", client="10.0.0.1")
    service.submit(ask(), owner="key-b", front="jobs", client="10.0.0.1")
    with pytest.raises(Refused):
        service.submit(ask(), owner="key-c", front="jobs", client="10.0.0.1")
    service.submit(ask(), owner="key-a", front="jobs", client="10.0.0.2")
    assert (service.held("10.0.0.1"), service.held("10.0.0.2"), service.held("key-a")) == (2, 1, 0)


def test_a_job_is_invisible_to_another_owner(fake, service):
    job = service.submit(ask(), owner="key-a", front="jobs")
    assert service.get(job.id, "key-a") is job
    with pytest.raises(JobNotFound):
        service.get(job.id, "key-b")
    with pytest.raises(JobNotFound):
        service.cancel(job.id, "key-b")
    assert not job.cancelled.is_set() and service.jobs("key-b") == []


def test_cancel_of_a_running_job_stops_it_within_a_step_and_the_next_job_runs(fake, service):
    running = service.submit(ask(steps=20), owner="a", front="jobs")
    queued = service.submit(ask(seed=20, steps=2), owner="b", front="jobs")
    fake.go(3)
    wait_for(lambda: running.step == 3)
    service.cancel(running.id, "a")
    wait_for(lambda: running.done)
    assert running.status == CANCELLED and running.result is None
    assert fake.steps_seen <= 4  # the step running when the cancel came, at most
    fake.go(2)
    wait_for(lambda: queued.done)
    assert queued.status == SUCCEEDED and queued.result.seeds == [20, 21]


def test_cancel_of_a_queued_job_takes_it_out_of_line_and_it_never_runs(fake, service):
    first = service.submit(ask(), owner="a", front="jobs")
    second = service.submit(ask(seed=99), owner="b", front="jobs")
    service.cancel(second.id, "b")
    assert second.status == CANCELLED and second.events()[-1][0] == CANCELLED
    fake.go(2)
    wait_for(lambda: first.done)
    time.sleep(0.05)
    assert [call.seed for call in fake.calls] == [10]


def test_a_skip_ends_the_running_call_and_the_next_call_follows_on(fake, service):
    job = service.submit(ask(images=4, steps=3), owner="a", front="a1111")
    fake.go(1)
    wait_for(lambda: job.step == 1)
    service.skip(job)
    wait_for(lambda: job.call == 1)
    fake.go(3)
    wait_for(lambda: job.done)
    assert job.status == SUCCEEDED and job.result.seeds == [12, 13]  # the first call's batch dropped
    assert job.result.stopped == "the request was stopped after step 1"


def test_a_bad_value_is_refused_at_submit_naming_its_field(service):
    with pytest.raises(InvalidRequest) as refused:
        service.submit(ask(width=40, height=32), owner="a", front="jobs")
    assert refused.value.field == "width/height"
    with pytest.raises(InvalidRequest, match="images: this server makes 1 to 8 images"):
        service.submit(ask(images=9), owner="a", front="jobs")
    with pytest.raises(InvalidRequest, match="style: unknown style 'Baroque'"):
        to_request(prompt="x", style="Baroque")


def test_the_paste_back_recorded_in_the_request_makes_the_answer(fake, service):
    original = np.full((32, 48, 3), 200, np.uint8)
    alpha = np.zeros((32, 48), np.float32)
    alpha[:, :24] = 1.0  # the left half is the engine's, the right half the original's
    job = service.submit(ask(width=48, height=32, paste_back=PasteBack(original, alpha)), owner="a", front="openai")
    fake.go(2)
    wait_for(lambda: job.done)
    assert job.result.images[0, 5, 3, 0] == 10 and job.result.images[0, 5, 40, 0] == 200


def test_a_closed_service_refuses_new_jobs_and_finishes_the_queued_ones(fake, service):
    job = service.submit(ask(), owner="a", front="jobs")
    service.close()
    with pytest.raises(Refused) as refused:
        service.submit(ask(), owner="b", front="jobs")
    assert refused.value.status == 503
    assert not service.idle()
    fake.go(2)
    wait_for(service.idle)
    assert job.status == SUCCEEDED


def test_a_job_id_of_the_clients_own_is_kept_and_may_not_be_reused(fake, service):
    job = service.submit(ask(), owner="a", front="a1111", job_id="task(abc)")
    assert service.get("task(abc)", "a") is job
    with pytest.raises(InvalidRequest, match="id: the job id 'task\\(abc\\)' is in use"):
        service.submit(ask(), owner="a", front="a1111", job_id="task(abc)")


def test_finished_jobs_are_dropped_past_the_stores_bounds_and_then_gone_not_unknown(fake):
    store = JobStore(keep_s=3600, keep_bytes=0)  # keeps no result once a newer one finishes
    service = Service(fake, slots=1, limit=4, store=store)
    try:
        first = service.submit(ask(), owner="a", front="jobs")
        fake.go(2)
        wait_for(lambda: first.done)
        with pytest.raises(JobGone):
            service.get(first.id, "a")
        with pytest.raises(JobNotFound):
            service.get(first.id, "b")  # another owner learns nothing, not even that it was there
    finally:
        service.close()


def test_followers_on_an_event_loop_are_woken_by_the_workers_thread(fake, service):
    job = service.submit(ask(), owner="a", front="jobs")

    async def follow():
        seen, names = 0, []
        while not job.done or seen < len(job.events()):
            events = await job.next_events(seen, timeout=5)
            seen += len(events)
            names += [name for name, _ in events]
        return names

    threading.Timer(0.05, fake.go, (2,)).start()
    names = asyncio.run(asyncio.wait_for(follow(), 10))
    assert names[-1] == SUCCEEDED and names.count("step") == 2


def test_a_service_job_makes_the_engines_own_images(engine):
    """The tiny engine (conftest's shared one): a job's images equal engine.generate's for the same request."""
    service = Service(engine, slots=1, limit=2)
    try:
        asked = to_request(prompt="a red circle", seed=5, num_inference_steps=2)
        job = service.submit(asked, owner="a", front="jobs")
        wait_for(lambda: job.done, 120)
        direct = engine.generate(dataclasses.replace(asked.engine))
        assert job.status == SUCCEEDED
        np.testing.assert_array_equal(job.result.images, direct.images)
        assert job.result.seeds == direct.seeds == [5, 6, 7, 8]
    finally:
        service.close()
