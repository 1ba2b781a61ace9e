"""serving/progress.Tracker: the running request's record, its estimate and its stop flag."""

import threading

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


def test_queue_count_is_kept_across_jobs_and_never_negative():
    t = Tracker()
    t.queued(+1)
    t.queued(+1)
    job = t.begin(2)
    t.queued(-1)
    assert t.snapshot().queued == 1
    t.end(job)
    assert t.snapshot().queued == 1
    t.queued(-1)
    t.queued(-1)
    assert t.snapshot().queued == 0


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
