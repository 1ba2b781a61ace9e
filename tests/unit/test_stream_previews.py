"""handler.stream_previews' yields (issue #23): nothing before the first denoising step, so the page keeps the
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
    assert info is None and [caption for _, caption in shown] == ["preview · step 2/2"] * 2
    try:
        next(stream)
    except StopIteration as end:
        assert end.value == ("gallery", "info", "record")
    else:
        raise AssertionError("expected the result")
