"""serving/progress.Tracker: the running request's record, its estimate and its stop flag."""

import io
import threading

import numpy as np
from PIL import Image

from sdxl_engine.serving import progress
from sdxl_engine.serving.progress import Snapshot, Tracker


def test_a_request_moves_through_the_record(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    t = Tracker()
    assert t.snapshot() == Snapshot() and t.snapshot().fraction == 0.0
    job = t.begin(10)
    assert t.snapshot() == Snapshot(job=job, steps=10, started=100.0)
    now[0] = 101.0
    t.stage(job, "on device")  # the loop's clock starts here
    now[0] = 103.0
    t.step(job, 4, 10, preview=b"png")
    snap = t.snapshot()
    assert (snap.step, snap.steps, snap.stage, snap.preview) == (4, 10, "on device", b"png")
    assert snap.eta_s == 2.0 / 4 * 6 and snap.fraction == 0.4  # 0.5 s a step, 6 steps left
    t.step(job, 5, 10)  # no new preview: the last one stays
    assert t.snapshot().preview == b"png"
    t.end(job)
    assert t.snapshot() == Snapshot()


def test_a_finished_job_cannot_write_over_the_next():
    t = Tracker()
    old = t.begin(5)
    t.end(old)
    new = t.begin(7)
    t.step(old, 3, 5)
    t.stage(old, "to host")
    t.end(old)
    snap = t.snapshot()
    assert (snap.job, snap.step, snap.steps, snap.stage) == (new, 0, 7, "")


def test_interrupt_reaches_the_running_request_only():
    t = Tracker()
    assert t.interrupt() is False and t.stop_requested() is False  # idle: nothing remembered
    job = t.begin(3)
    assert t.interrupt() is True and t.stop_requested() is True
    t.end(job)
    assert t.stop_requested() is False
    t.begin(3)
    assert t.stop_requested() is False  # a new request starts unstopped


def test_an_array_preview_becomes_one_png_of_the_batchs_grid_when_read():
    t = Tracker()
    job = t.begin(4)
    batch = np.stack([np.full((2, 3, 3), v, np.uint8) for v in (10, 20, 30, 40)])
    t.step(job, 1, 4, preview=batch)
    with Image.open(io.BytesIO(t.snapshot().preview)) as png:
        grid = np.asarray(png.convert("RGB"))
    assert grid.shape == (4, 6, 3)  # 2 x 2 of (2, 3)
    assert [grid[0, 0, 0], grid[0, 3, 0], grid[2, 0, 0], grid[2, 3, 0]] == [10, 20, 30, 40]
    t.step(job, 2, 4, preview=batch[:1])
    with Image.open(io.BytesIO(t.snapshot().preview)) as png:
        assert png.size == (3, 2)  # a batch of one: that image


def test_threads_see_whole_records():
    t, seen = Tracker(), []
    job = t.begin(1000)
    t.stage(job, "on device")

    def writer():
        for k in range(1, 1001):
            t.step(job, k, 1000)

    def reader():
        for _ in range(2000):
            s = t.snapshot()
            seen.append(s.step <= s.steps == 1000)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert all(seen) and t.snapshot().step == 1000
