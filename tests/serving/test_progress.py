"""serving/progress.Jobs: each request's record, its estimate and its stop flags, addressed by its id and
read or stopped only by its owner."""

import io
import threading

import numpy as np
from PIL import Image

from sdxl_engine.serving import progress
from sdxl_engine.serving.progress import Jobs, Snapshot

ME, OTHER_ADDRESS, PAGE = ("a1111", "127.0.0.1"), ("a1111", "127.0.0.2"), ("gradio", "session-1")


def test_a_request_moves_through_the_record(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    t = Jobs()
    assert t.snapshot(ME) == Snapshot() and t.snapshot(ME).fraction == 0.0
    job = t.open(ME)
    t.begin_call(job, 10)
    assert t.snapshot(ME) == Snapshot(job=job, calls=1, steps=10, started=100.0)
    now[0] = 101.0
    t.stage(job, "on device")  # the loop's clock starts here
    now[0] = 103.0
    t.step(job, 4, 10, preview=b"png")
    snap = t.snapshot(ME)
    assert (snap.step, snap.steps, snap.stage, snap.preview) == (4, 10, "on device", b"png")
    assert snap.eta_s == 2.0 / 4 * 6 and snap.fraction == 0.4  # 0.5 s a step, 6 steps left
    t.step(job, 5, 10)  # no new preview: the last one stays
    assert t.snapshot(ME).preview == b"png"
    t.end_call(job)
    t.close(job)
    assert t.snapshot(ME) == Snapshot()


def test_a_job_of_several_calls_counts_them_all(monkeypatch):
    """16 images = 4 engine calls: progress and eta cover the whole job, not the running call alone."""
    now = [0.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    t = Jobs()
    job = t.open(ME, calls=4)
    t.begin_call(job, 10)
    t.stage(job, "on device")
    now[0] = 5.0
    t.step(job, 10, 10)
    t.end_call(job)
    t.begin_call(job, 10)
    snap = t.snapshot(ME)
    assert (snap.call, snap.calls, snap.step, snap.fraction) == (1, 4, 0, 0.25)
    t.stage(job, "on device")
    now[0] = 6.0
    t.step(job, 2, 10)  # 0.5 s a step: 8 left in this call, 10 in each of the 2 calls after it
    snap = t.snapshot(ME)
    assert snap.fraction == (1 + 0.2) / 4 and snap.eta_s == 0.5 * 8 + 0.5 * 10 * 2
    for _ in range(5):  # never past the last call, however often a call begins
        t.begin_call(job, 10)
    assert t.snapshot(ME).call == 3


def test_a_closed_job_cannot_write_over_the_next():
    t = Jobs()
    old = t.open(ME)
    t.begin_call(old, 5)
    t.close(old)
    new = t.open(ME)
    t.begin_call(new, 7)
    t.step(old, 3, 5, preview=np.zeros((4, 2, 2, 3), np.uint8))  # the finished job's late preview: dropped
    t.step(old, 4, 5, preview=b"old png")
    t.stage(old, "to host")
    t.end_call(old)
    t.close(old)
    snap = t.snapshot(ME)
    assert (snap.job, snap.step, snap.steps, snap.stage, snap.preview) == (new, 0, 7, "", None)
    assert t.stop_requested(old) is False and t.running() == 1


def test_interrupt_and_progress_reach_only_the_owners_own_requests():
    """One client's interrupt never stops a page's request or another address's, and its progress
    shows only its own request; with several jobs running at once (replicas) each keeps its own flags."""
    t = Jobs()
    assert t.interrupt(ME) is False and t.skip(ME) is False  # nothing of its own: nothing remembered
    page, mine, theirs = t.open(PAGE), t.open(ME), t.open(OTHER_ADDRESS)
    for job, steps in ((page, 50), (mine, 20), (theirs, 30)):
        t.begin_call(job, steps)
    t.step(theirs, 7, 30, preview=b"theirs")
    assert t.snapshot(ME).job == mine and t.snapshot(ME).step == 0 and t.snapshot(ME).preview is None
    assert t.snapshot(OTHER_ADDRESS).preview == b"theirs"
    assert t.interrupt(ME) is True
    assert [t.stop_requested(j) for j in (page, mine, theirs)] == [False, True, False]
    assert t.snapshot(ME).interrupted is True and t.snapshot(OTHER_ADDRESS).interrupted is False
    t.close(mine)
    assert t.interrupt(ME) is False and t.stop_requested(mine) is False


def test_skip_ends_the_running_call_only_and_interrupt_the_whole_job():
    t = Jobs()
    job = t.open(ME, calls=3)
    t.begin_call(job, 10)
    assert t.skip(ME) is True
    assert (t.stop_requested(job), t.interrupted(job), t.snapshot(ME).skipped) == (True, False, True)
    t.end_call(job)
    t.begin_call(job, 10)  # the next call starts unstopped
    assert (t.stop_requested(job), t.snapshot(ME).skipped) == (False, False)
    assert t.interrupt(ME) is True
    t.begin_call(job, 10)  # an interrupt outlives the call: the job's later calls are not to run
    assert t.stop_requested(job) is True and t.interrupted(job) is True


def test_an_array_preview_becomes_one_png_of_the_batchs_grid_when_read():
    t = Jobs()
    job = t.open(ME)
    t.begin_call(job, 4)
    batch = np.stack([np.full((2, 3, 3), v, np.uint8) for v in (10, 20, 30, 40)])
    t.step(job, 1, 4, preview=batch)
    with Image.open(io.BytesIO(t.snapshot(ME).preview)) as png:
        grid = np.asarray(png.convert("RGB"))
    assert grid.shape == (4, 6, 3)  # 2 x 2 of (2, 3)
    assert [grid[0, 0, 0], grid[0, 3, 0], grid[2, 0, 0], grid[2, 3, 0]] == [10, 20, 30, 40]
    t.step(job, 2, 4, preview=batch[:1])
    with Image.open(io.BytesIO(t.snapshot(ME).preview)) as png:
        assert png.size == (3, 2)  # a batch of one: that image
    t.begin_call(job, 4)
    assert t.snapshot(ME).preview is None  # a new call's preview is its own


def test_threads_see_whole_records():
    t, seen = Jobs(), []
    job = t.open(ME)
    t.begin_call(job, 1000)
    t.stage(job, "on device")

    def writer():
        for k in range(1, 1001):
            t.step(job, k, 1000)

    def reader():
        for _ in range(2000):
            s = t.snapshot(ME)
            seen.append(s.step <= s.steps == 1000)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert all(seen) and t.snapshot(ME).step == 1000


def test_a_new_call_drops_the_previous_calls_unread_array_preview():
    """A call's last array preview, never read (no snapshot between its step and the next call's start), is not
    the next call's preview: after begin_call the snapshot has none until that call sends its own, and a step of
    the new call without a preview does not bring the old one back."""
    t = Jobs()
    job = t.open(ME, calls=2)
    t.begin_call(job, 4)
    first = np.stack([np.full((2, 3, 3), v, np.uint8) for v in (10, 20, 30, 40)])
    t.step(job, 4, 4, preview=first)  # unread
    t.end_call(job)
    t.begin_call(job, 4)
    snap = t.snapshot(ME)
    assert (snap.call, snap.step, snap.preview) == (1, 0, None)
    t.step(job, 1, 4)
    assert t.snapshot(ME).preview is None
    t.step(job, 2, 4, preview=np.full((2, 3, 3), 99, np.uint8))
    with Image.open(io.BytesIO(t.snapshot(ME).preview)) as png:
        assert png.size == (3, 2) and (np.asarray(png.convert("RGB")) == 99).all()  # the new call's own
