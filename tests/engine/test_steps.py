"""engine/steps.StepReceiver without a program: the devices' calls are made by hand, as the compiled loop makes
them (a call at step 0, then at the step the last answer named, and always at the last step), on a fake clock,
so the call cadence, the preview cadence (fixed and timed), the step events, the stop answer and errors are
checked step by step."""

import numpy as np
import pytest

from sdxl_engine.engine import steps as steps_mod
from sdxl_engine.engine.steps import AUTO, StepReceiver


def rgb(x0: np.ndarray) -> np.ndarray:
    """A stand-in latents-to-RGB map: (b, C, h, w) -> (b, h, w, 3) uint8 of the first channel."""
    return np.repeat(x0[:, :1].transpose(0, 2, 3, 1), 3, axis=-1).astype(np.uint8)


def run(monkeypatch, receiver: StepReceiver, steps: int, step_s: float, shards: int = 2) -> list[tuple[int, bool]]:
    """Run ``steps`` device steps of ``step_s`` seconds each; the devices call ``receiver`` as denoise_step does
    (x0 along only when the previous answer asked for it). Returns each call's (1-based step, x0 sent)."""
    now = [0.0]
    monkeypatch.setattr(steps_mod, "clock", lambda: now[0])
    send, nxt, calls = False, 0, []
    for step in range(steps):
        now[0] = step * step_s
        if step < nxt and step != steps - 1:
            continue  # the devices run this step without calling the host
        answers = [receiver(shard, step, np.full((2, 4, 2, 2), step, np.float32) if send else None)
                   for shard in range(shards)]
        assert len(set(answers)) == 1  # every device hears the same answer, so their x0 come together
        calls.append((step + 1, send))
        stop, send, nxt = answers[0]
        assert nxt > step or step == steps - 1
        if stop:
            break
    return calls


def test_slow_steps_each_call_and_a_fixed_cadence_previews_every_nth_step_but_the_last(monkeypatch):
    events = []
    receiver = StepReceiver(2, 10, 3, rgb, events.append, None)
    calls = run(monkeypatch, receiver, 10, step_s=0.2)  # an accelerator's pace: every step calls
    assert [c[0] for c in calls] == [e.step for e in events] == list(range(1, 11)) and receiver.done == 10
    assert [e.step for e in events if e.preview is not None] == [3, 6, 9]  # 1-based multiples of 3; 10's images follow
    preview = next(e.preview for e in events if e.step == 3)
    assert preview.shape == (4, 2, 2, 3) and (preview == 2).all()  # both shards' x0 of 0-based step 2, in order


def test_fast_steps_call_about_every_report_interval_and_still_at_each_fixed_preview(monkeypatch):
    events = []
    calls = run(monkeypatch, StepReceiver(2, 10, 3, rgb, events.append, None), 10, step_s=0.02)
    # 0.02 s a step: 5 steps per 0.1 s, but a preview every 3 steps asks for those calls
    assert [c[0] for c in calls] == [1, 2, 3, 6, 9, 10]
    assert [e.step for e in events if e.preview is not None] == [3, 6, 9]


def test_fast_steps_without_previews_call_the_host_a_few_times_only(monkeypatch):
    events = []
    calls = run(monkeypatch, StepReceiver(2, 20, 0, rgb, events.append, None), 20, step_s=0.02)
    # step 1 calls (nothing measured yet), step 2 measures 0.02 s a step, then every 5 steps, and the last
    assert [c[0] for c in calls] == [e.step for e in events] == [1, 2, 7, 12, 17, 20]
    assert all(e.preview is None for e in events) and not any(sent for _, sent in calls)


def test_the_timed_cadence_asks_for_a_preview_about_every_half_second(monkeypatch):
    events = []
    run(monkeypatch, StepReceiver(2, 12, AUTO, rgb, events.append, None), 12, step_s=0.2)
    # step 3 (0-based 2) sees 0.2 s a step: the next call ends 0.6 s after the last preview (the start), so step 4
    # sends x0; then every 3 steps (0.6 s >= 0.5 s), never the last
    assert [e.step for e in events if e.preview is not None] == [4, 7, 10]
    events = []
    run(monkeypatch, StepReceiver(2, 80, AUTO, rgb, events.append, None), 80, step_s=0.02)
    previews = [e.step for e in events if e.preview is not None]
    assert previews == [27, 52, 77]  # calls every 5 steps (0.1 s); x0 at the first call 0.5 s or more after the last


def test_a_loop_that_starts_past_step_0_measures_its_pace_from_its_first_call(monkeypatch):
    """img2img runs the last steps of a schedule: its pace is time over the steps it ran, not the step index."""
    now = [0.0]
    monkeypatch.setattr(steps_mod, "clock", lambda: now[0])
    receiver = StepReceiver(1, 30, 0, None, None, None)
    assert receiver(0, 20, None) == (False, False, 21)  # the first call: nothing measured yet
    now[0] = 0.02
    assert receiver(0, 21, None) == (False, False, 26)  # 0.02 s a step: the next call 0.1 s on, 5 steps


def test_a_stop_is_heard_at_the_next_call_and_ends_the_loop(monkeypatch):
    events = []
    receiver = StepReceiver(2, 50, 0, rgb, events.append, lambda: len(events) >= 3)
    calls = run(monkeypatch, receiver, 50, step_s=0.02)
    # events at 1, 2, 7: the call at 12 hears the stop (0.1 s of device time later)
    assert [e.step for e in events] == [1, 2, 7, 12] and receiver.stopped and receiver.done == 12
    assert calls[-1][0] == 12


def test_an_error_in_on_step_ends_the_loop_and_is_kept_for_after_the_program(monkeypatch):
    def on_step(event):
        if event.step == 2:
            raise KeyError("the page's queue is gone")

    receiver = StepReceiver(1, 10, 0, None, on_step, None)
    calls = run(monkeypatch, receiver, 10, step_s=0.2, shards=1)
    assert len(calls) == 2 and isinstance(receiver.error, KeyError)


@pytest.mark.parametrize("every", [1, 2])
def test_a_preview_map_missing_means_no_previews_whatever_the_setting(monkeypatch, every):
    events = []
    run(monkeypatch, StepReceiver(2, 6, every, None, events.append, None), 6, step_s=0.2)
    assert all(e.preview is None for e in events) and len(events) == 6
