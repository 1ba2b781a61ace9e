"""One request's per-step progress, previews and stop, the host side of the program's step hook.

A program with the step hook (ProgramShape.step_hook) runs its steps in chunks driven by the host
(compiling.SteppedExecutable), which calls a :class:`StepReceiver` for every device's shard after each
chunk. It counts the calls for each step; when the last shard has reported step k it calls the request's
``on_step(StepEvent)``; every call answers whether to stop (the request's ``should_stop()``), whether
the next report should bring its x0 estimate for a preview, and the last step of the next chunk: the
next step while steps take :data:`REPORT_INTERVAL_S` or more (an accelerator's SDXL step), else every
few steps, so fast steps do not wait on the host each time. A stop is then heard within
``max(one step, REPORT_INTERVAL_S)`` of device time.

The devices wait while the host reports, so everything here returns at once: the preview is a (C x 3)
map per latent pixel (previews.LatentRGB), and ``on_step`` must only hand its event on (the page's
handler puts it in a queue).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from collections.abc import Callable

import numpy as np

from sdxl_engine.engine.contract import clock
from sdxl_engine.engine.previews import LatentRGB

AUTO = -1  # preview_every: choose the steps between previews from the measured step time
AUTO_INTERVAL_S = 0.5  # ... so that a preview comes about twice a second
# The host reports about this often (never less than once a step): the progress line moves about
# ten times a second and a stop is heard within this much device time, while a loop of fast steps (a small
# model on CPUs) does not stop for a host round trip at every step.
REPORT_INTERVAL_S = 0.1


class Stopped(RuntimeError):
    """The request was stopped (its ``should_stop()`` answered True) before it finished; no images."""


def wait_or_stop(future, should_stop: Callable[[], bool] | None, why: str, poll_s: float = 0.1) -> None:
    """Wait for ``future`` (a concurrent.futures.Future: a model's load, a size's compile), asking ``should_stop()``
    every ``poll_s`` seconds; the future goes on for the next request when this one stops.

    Raises Stopped(``why``) when ``should_stop()`` says so; the future's own exception when it failed."""
    while True:
        try:
            future.result(timeout=poll_s)
            return
        except concurrent.futures.TimeoutError:
            if should_stop is not None and should_stop():
                raise Stopped(why) from None


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """Denoising step ``step`` of ``steps`` finished on every device (1-based).

    ``preview``: None, or (batch, h, w, 3) uint8 RGB at latent resolution (h = height / f): the
    current x0 estimate through the model's latents-to-RGB map. ``elapsed_s``: seconds from the
    loop's first call to this step's last.
    """

    step: int
    steps: int
    preview: np.ndarray | None = None
    elapsed_s: float = 0.0


class StepReceiver:
    """The receiver a stepped program reports to for one request (see the module docstring).

    Args:
        shards: devices on the mesh's ``data`` axis (each calls once per step).
        steps: denoising steps the request runs.
        preview_every: steps between previews; :data:`AUTO` (-1): about every
            :data:`AUTO_INTERVAL_S` seconds from the measured step time; 0: none.
        latent_rgb: the model's preview map, or None (no previews).
        on_step: called with a :class:`StepEvent` once every device has reported a step.
        should_stop: polled at every call; True stops the loop after the running step.

    ``done``: the last step every device has reported (the request's progress); ``stopped``: a call answered stop.
    """

    def __init__(self, shards: int, steps: int, preview_every: int, latent_rgb: LatentRGB | None,
                 on_step: Callable[[StepEvent], None] | None, should_stop: Callable[[], bool] | None):
        self.shards, self.steps = shards, steps
        self.every = preview_every if latent_rgb is not None else 0
        self.latent_rgb, self.on_step, self.should_stop = latent_rgb, on_step, should_stop
        self.stopped = False  # a call answered stop
        self.error: Exception | None = None  # what on_step/should_stop raised; the engine raises it after the program
        self.done = 0  # steps every device has reported
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._parts: dict[int, dict[int, np.ndarray]] = {}  # step -> shard -> its x0
        self._decisions: dict[int, tuple[bool, int]] = {}  # step -> (whether the next call sends x0, its step)
        self._started: float | None = None
        self._first = 0  # the 0-based step of the loop's first call
        self._last_preview: float | None = None

    def __call__(self, shard: int, step: int, x0: np.ndarray | None) -> tuple[bool, bool, int]:
        """One shard's report of 0-based ``step`` (``x0``: None, or its (b_local, C, h, w) float32 x0 estimate, when
        the previous answer asked for it): returns (stop, whether the next report sends x0, the 0-based step of the
        next report)."""
        now = clock()
        with self._lock:
            if self._started is None:  # the loop's first call: img2img starts past step 0
                self._started, self._last_preview, self._first = now, now, step
            if x0 is not None:  # copied: the caller's array may be a view of a buffer it reuses
                self._parts.setdefault(step, {})[shard] = np.array(x0, copy=True)
            self._counts[step] = self._counts.get(step, 0) + 1
            if step not in self._decisions:  # one answer per step for every device, so their x0 come together
                self._decisions[step] = self._next_call(step, now)
            complete = self._counts[step] == self.shards
            parts = self._parts.pop(step, None) if complete else None
            if complete:
                self.done = step + 1
            try:
                if not self.stopped and self.should_stop is not None and self.should_stop():
                    self.stopped = True
            except Exception as err:  # raised after the chunk (see error), as the engine's own errors are
                self._fail(err)
            elapsed = now - self._started
        if complete and self.on_step is not None and self.error is None:
            preview = None
            if parts is not None and len(parts) == self.shards:
                preview = self.latent_rgb(np.concatenate([parts[k] for k in sorted(parts)]))  # (b, h, w, 3)
            try:
                self.on_step(StepEvent(step + 1, self.steps, preview, elapsed))
            except Exception as err:
                with self._lock:
                    self._fail(err)
        return (self.stopped or self.error is not None, *self._decisions[step])

    def _fail(self, err: Exception) -> None:
        """Keep the first error of ``on_step``/``should_stop`` and end the loop (call with the lock held)."""
        if self.error is None:
            self.error = err

    def _next_call(self, step: int, now: float) -> tuple[bool, int]:
        """(whether the next call sends x0, its 0-based step) after 0-based ``step``: about
        :data:`REPORT_INTERVAL_S` of steps on (at least the next step; the first steps, unmeasured, each
        call), no further than the next fixed-cadence preview, and at most the last step. x0 is never sent
        with the last step (its images follow)."""
        ran = step - self._first  # steps run since the first call
        per_step = (now - self._started) / ran if ran else math.inf
        gap = 1 if per_step == math.inf else max(1, int(REPORT_INTERVAL_S / per_step))
        nxt = min(step + gap, self.steps - 1)
        if self.every > 0:  # the next preview step (1-based multiples of ``every``), if it comes first
            preview_step = (step + 1) // self.every * self.every + self.every - 1
            nxt = min(nxt, preview_step)
            return nxt == preview_step and nxt < self.steps - 1, nxt
        if self.every == 0 or nxt >= self.steps - 1 or per_step == math.inf:
            return False, nxt
        at = now + (nxt - step) * per_step  # when the next call comes, at the measured pace
        if at - self._last_preview >= AUTO_INTERVAL_S:
            self._last_preview = at
            return True, nxt
        return False, nxt
