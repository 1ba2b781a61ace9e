"""handler.stream_previews' yields: nothing before the first denoising step, so the page keeps the
wait's progress line (start-up, queue, compile); keep-alive yields once the loop runs, so a cancel can close the
generator, which asks the engine to stop."""

import threading
import time

import numpy as np

from sdxl_engine.engine.steps import StepEvent
from sdxl_engine.serving import handler


def test_no_yield_while_waiting_then_keep_alives_and_a_close_stops_the_engine(monkeypatch, tmp_path):
    monkeypatch.setattr(handler, "PREVIEW_WAIT_S", 0.05)
    monkeypatch.setattr(handler.gr.utils, "get_upload_folder", lambda: str(tmp_path))
    begin_steps, stopped = threading.Event(), threading.Event()

    def generate(*values, progress, arrived, on_step, should_stop):
        begin_steps.wait(10)  # the wait before the loop: start-up, the request ahead, a compile
        on_step(StepEvent(1, 50))  # a step without a preview
        while not should_stop():
            time.sleep(0.01)
        stopped.set()
        raise RuntimeError("stopped")

    stream = handler.stream_previews(generate, (), None, None)
    got = []
    reader = threading.Thread(target=lambda: got.append(next(stream)), daemon=True)
    reader.start()
    reader.join(0.5)  # ten keep-alive periods of waiting: still nothing yielded
    assert got == [] and reader.is_alive()
    begin_steps.set()
    reader.join(5)
    assert got == [([], None)]  # a keep-alive once the loop runs: the gallery as it was
    assert not stopped.is_set()
    stream.close()  # what Gradio does when the client cancels
    assert stopped.wait(5)


def test_previews_are_yielded_as_they_come_and_the_result_is_returned(monkeypatch, tmp_path):
    monkeypatch.setattr(handler, "PREVIEW_WAIT_S", 5.0)
    monkeypatch.setattr(handler.gr.utils, "get_upload_folder", lambda: str(tmp_path))
    preview = np.zeros((2, 4, 4, 3), np.uint8)

    def generate(*values, progress, arrived, on_step, should_stop):
        on_step(StepEvent(1, 2))
        on_step(StepEvent(2, 2, preview=preview))
        return "gallery", "info", "record"

    stream = handler.stream_previews(generate, (), None, None)
    shown, info = next(stream)
    assert info is None and [caption for _, caption in shown] == ["preview · step 2/2"]  # the batch in one image
    try:
        next(stream)
    except StopIteration as end:
        assert end.value == ("gallery", "info", "record")
    else:
        raise AssertionError("expected the result")


def test_a_client_cancel_stops_the_engine_though_nothing_was_yielded(monkeypatch, tmp_path):
    """Gradio closes a generator only once it has yielded: a cancel noted by the server (guard.CANCELLED)
    reaches the engine's should_stop without a yield, also before the loop (then the request never runs)."""
    monkeypatch.setattr(handler, "PREVIEW_WAIT_S", 0.05)
    monkeypatch.setattr(handler.gr.utils, "get_upload_folder", lambda: str(tmp_path))
    cancels = handler.guard.Cancels()
    asked = []

    def generate(*values, progress, arrived, on_step, should_stop):
        deadline = time.monotonic() + 10
        while not should_stop() and time.monotonic() < deadline:  # the engine asks before it starts
            time.sleep(0.01)
        asked.append(should_stop())
        raise handler.Stopped("stopped before it started")

    stream = handler.stream_previews(generate, (), None, None, lambda: ("s1", "e1") in cancels)
    got, errors = [], []

    def read():
        try:
            got.extend(stream)
        except handler.Stopped as err:
            errors.append(str(err))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.2)
    cancels.add("s2", "e1")  # another session's event of that id: not this one
    cancels.add("s1", "e2")
    time.sleep(0.2)
    assert asked == [] and reader.is_alive()
    cancels.add("s1", "e1")
    reader.join(5)
    assert asked == [True] and got == [] and errors == ["stopped before it started"]


def test_the_cancels_are_pairs_kept_for_a_while():
    cancels = handler.guard.Cancels(keep_s=10)
    cancels.add("s", "e", now=100.0)
    assert ("s", "e") in cancels and ("s", "x") not in cancels and ("x", "e") not in cancels
    cancels.add("t", "f", now=109.0)
    assert ("s", "e") in cancels
    cancels.add("u", "g", now=111.0)  # forgotten after keep_s
    assert ("s", "e") not in cancels and ("t", "f") in cancels
    for body in (b"not json", b"[1]", b'{"session_hash": 1, "event_id": "e"}', b'{"event_id": "e"}'):
        cancels.note(body)  # left to Gradio to refuse
    cancels.note(b'{"session_hash": "s9", "fn_index": 3, "event_id": "e9"}')
    assert ("s9", "e9") in cancels
    # gradio_client's job.cancel() before it knows the event id posts event_id null: the session's calls
    # that arrived before the cancel are cancelled, not later ones
    cancels.note(b'{"session_hash": "s7", "fn_index": 3, "event_id": null}')
    now = handler.guard.clock()
    assert cancels.cancelled("s7", "any", since=now - 1) and not cancels.cancelled("s7", "any", since=now + 1)
    assert not cancels.cancelled("s8", "any", since=now - 1) and cancels.cancelled("s9", "e9", since=now + 1)
    few = handler.guard.Cancels(limit=3)
    for i in range(5):
        few.add("s", f"e{i}", now=1.0)
    assert [("s", f"e{i}") in few for i in range(5)] == [False, False, True, True, True]  # the newest 3
