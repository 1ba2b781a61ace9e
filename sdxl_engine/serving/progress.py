"""What the served process is doing now: one record of the running request, for every protocol.

The handler (handler.py) writes it as a request moves (:meth:`Tracker.begin`, :meth:`Tracker.stage`,
:meth:`Tracker.step`, :meth:`Tracker.end`); readers take a :class:`Snapshot` (the page's progress,
AUTOMATIC1111's ``GET /sdapi/v1/progress``). :meth:`Tracker.interrupt` asks the running request to
stop (the page's Stop, A1111's ``POST /sdapi/v1/interrupt``); the engine reads
:meth:`Tracker.stop_requested` between denoising steps. Thread-safe: Gradio's workers and the
API routes run on different threads. No Gradio import.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from sdxl_engine.engine.contract import clock
from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.serving.images import png_bytes


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The running request as one reader sees it; ``job`` None = idle.

    ``step``/``steps``: denoising steps done / to run (0/0 before the loop starts); ``stage``: the
    engine's stage name (handler.STAGES); ``started``: contract.clock() at begin; ``eta_s``: the
    seconds left, estimated from the steps so far (None until a step has run); ``preview``: the
    latest preview as PNG bytes, the batch in one grid (previews.preview_grid; None: none yet or
    previews off).
    """

    job: int | None = None
    stage: str = ""
    step: int = 0
    steps: int = 0
    started: float | None = None
    eta_s: float | None = None
    preview: bytes | None = None

    @property
    def fraction(self) -> float:
        """0..1: the share of denoising steps done (0 when idle)."""
        return self.step / self.steps if self.steps else 0.0


class Tracker:
    """The one running request's progress and its stop flag (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._now = Snapshot()
        self._step_started: float | None = None  # clock() when step 1 began (the loop's start)
        self._stop = threading.Event()
        self._preview_image: np.ndarray | None = None  # issue #23: the latest preview, PNG-encoded on demand

    def begin(self, steps: int) -> int:
        """A request starts on the engine: returns its job id; clears a stale stop request."""
        with self._lock:
            self._stop.clear()
            job = next(self._ids)
            self._now = Snapshot(job=job, steps=steps, started=clock())
            self._step_started = None
            self._preview_image = None
            return job

    def stage(self, job: int, stage: str) -> None:
        """The engine's stage changed (ignored for a job that is no longer the running one)."""
        with self._lock:
            if self._now.job == job:
                self._now = dataclasses.replace(self._now, stage=stage)
                if stage == "on device" and self._step_started is None:
                    self._step_started = clock()

    def step(self, job: int, step: int, steps: int, preview: bytes | np.ndarray | None = None) -> None:
        """Denoising step ``step`` of ``steps`` finished (1-based); ``preview`` replaces the last one if given:
        PNG bytes, or the batch's previews as (b, h, w, 3) uint8 (or one (h, w, 3) image), which become one PNG
        (their grid) only when a snapshot is taken (this is called on the devices' callback thread, which must
        not wait for an encode)."""
        if isinstance(preview, np.ndarray):
            with self._lock:
                if self._now.job == job:
                    self._preview_image = preview
            preview = None
        with self._lock:
            if self._now.job != job:
                return
            now = clock()
            if self._step_started is None:
                self._step_started = now
            elapsed = now - self._step_started
            eta = elapsed / step * (steps - step) if step > 0 else None
            self._now = dataclasses.replace(self._now, step=step, steps=steps, eta_s=eta,
                                            preview=preview if preview is not None else self._now.preview)

    def end(self, job: int) -> None:
        """The request finished, failed or stopped: the tracker is idle again."""
        with self._lock:
            if self._now.job == job:
                self._now = Snapshot()
                self._stop.clear()
                self._preview_image = None

    def snapshot(self) -> Snapshot:
        """The current record (immutable)."""
        with self._lock:
            if self._preview_image is not None:  # the latest array preview, encoded once
                self._now = dataclasses.replace(self._now, preview=png_bytes(preview_grid(self._preview_image)))
                self._preview_image = None
            return self._now

    def interrupt(self) -> bool:
        """Ask the running request to stop; False when nothing runs (then nothing is remembered)."""
        with self._lock:
            if self._now.job is None:
                return False
            self._stop.set()
            return True

    def stop_requested(self) -> bool:
        """Whether :meth:`interrupt` was called since the running request began."""
        return self._stop.is_set()


TRACKER = Tracker()  # the served process's one tracker
