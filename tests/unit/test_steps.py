"""engine/steps.StepReceiver without a program: the devices' per-step calls are made by hand, so the preview
cadence (fixed and timed), the step events, the stop answer and errors are checked step by step."""

import numpy as np
import pytest

from sdxl_engine.engine import steps as steps_mod
from sdxl_engine.engine.steps import AUTO, StepReceiver


def rgb(x0: np.ndarray) -> np.ndarray:
    """A stand-in latents-to-RGB map: (b, C, h, w) -> (b, h, w, 3) uint8 of the first channel."""
    return np.repeat(x0[:, :1].transpose(0, 2, 3, 1), 3, axis=-1).astype(np.uint8)


def run(receiver: StepReceiver, steps: int, shards: int = 2, clock=None) -> list[tuple[int, bool]]:
    """Call ``receiver`` as ``shards`` devices do for ``steps`` steps, each sending x0 only when the previous
    answer asked for it (as the program does); returns each step's (1-based step, whether x0 came with it)."""
    send, sent = False, []
    for step in range(steps):
        if clock is not None:
            clock(step)
        answers = [receiver(shard, step, np.full((2, 4, 2, 2), step, np.float32) if send else None)
                   for shard in range(shards)]
        assert len(set(answers)) == 1  # every device hears the same answer, so their x0 come together
        sent.append((step + 1, send))
        stop, send = answers[0]
        if stop:
            break
    return sent


def test_a_fixed_cadence_previews_every_nth_step_and_never_the_last():
    events = []
    receiver = StepReceiver(2, 10, 3, rgb, events.append, None)
    run(receiver, 10)
    assert [e.step for e in events] == list(range(1, 11)) and receiver.done == 10
    assert [e.step for e in events if e.preview is not None] == [3, 6, 9]  # 1-based multiples of 3; 10's images follow
    preview = next(e.preview for e in events if e.step == 3)
    assert preview.shape == (4, 2, 2, 3) and (preview == 2).all()  # both shards' x0 of 0-based step 2, in order


def test_the_timed_cadence_asks_for_a_preview_about_every_half_second(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(steps_mod, "clock", lambda: now[0])
    events = []
    receiver = StepReceiver(2, 12, AUTO, rgb, events.append, None)
    run(receiver, 12, clock=lambda step: now.__setitem__(0, 0.2 * step))  # 0.2 s a step
    # step 3 (0-based 2) sees 0.2 s a step: the next one ends 0.6 s after the last preview (the start), so step 4
    # sends x0; then every 3 steps (0.6 s >= 0.5 s), never the last
    assert [e.step for e in events if e.preview is not None] == [4, 7, 10]


def test_no_previews_send_no_latents_and_a_stop_ends_the_loop_after_the_running_step():
    events, asked = [], []

    def should_stop():
        asked.append(len(events))
        return len(events) >= 4

    receiver = StepReceiver(2, 10, 0, rgb, events.append, should_stop)
    sent = run(receiver, 10)
    assert [s for s in sent if s[1]] == [] and all(e.preview is None for e in events)
    assert receiver.stopped and receiver.done == 5 and [e.step for e in events] == [1, 2, 3, 4, 5]


def test_an_error_in_on_step_ends_the_loop_and_is_kept_for_after_the_program():
    def on_step(event):
        if event.step == 2:
            raise KeyError("the page's queue is gone")

    receiver = StepReceiver(1, 10, 0, None, on_step, None)
    sent = run(receiver, 10, shards=1)
    assert len(sent) == 2 and isinstance(receiver.error, KeyError)


@pytest.mark.parametrize("every", [1, 2])
def test_a_preview_map_missing_means_no_previews_whatever_the_setting(every):
    events = []
    run(StepReceiver(2, 6, every, None, events.append, None), 6)
    assert all(e.preview is None for e in events) and len(events) == 6
