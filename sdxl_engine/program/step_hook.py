"""The host end of the compiled programs' per-step callback: :data:`STEP_HOOK`, which every program built with
``ProgramShape.step_hook`` calls through ``io_callback`` (engine/steps.py is the receiver it hands the calls to)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import numpy as np


class StepHook:
    """The host end of the compiled programs' per-step callback (ProgramShape.step_hook).

    A compiled program calls :meth:`call` at the denoising steps the receiver asks for, on every device of the mesh
    (inside ``shard_map``: each device with its own images); the call is synchronous, so the
    receiver must return at once (copy what it needs, do the work on another thread). One
    receiver at a time (the engine runs one request at a time), installed around a program call
    with :meth:`receiving`; with none installed every call answers "go on, no preview".

    The receiver is ``fn(shard, step, x0) -> (stop, preview_next, next_report)``: ``shard`` the device's
    index on the ``data`` axis, ``step`` 0-based, ``x0`` None or this shard's current estimate of the
    clean latents, (b_local, C, h, w) float32 numpy (sent only when the previous call asked for it with
    ``preview_next``, so a call without a preview moves no latents to the host); ``next_report``: the
    0-based step at which the devices call next (the last step always calls), so the host decides how
    often the devices stop to call it (engine/steps.py: every step when steps are slow, as on an
    accelerator; every few when they are fast).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._receiver: Callable | None = None

    @contextlib.contextmanager
    def receiving(self, fn: Callable):
        """Send the per-step calls to ``fn`` (see the class docstring) while the block runs."""
        with self._lock:
            self._receiver = fn
        try:
            yield
        finally:
            with self._lock:
                self._receiver = None

    def call(self, shard, step, x0=None):
        """What the program calls (through ``io_callback``): returns (stop, preview_next, next_report) as numpy
        (bool, bool, int32); with no receiver: go on, no preview, call again at the next step."""
        fn = self._receiver
        if fn is None:
            return np.bool_(False), np.bool_(False), np.int32(int(step) + 1)
        stop, preview, next_report = fn(int(shard), int(step), None if x0 is None else np.asarray(x0))
        return np.bool_(stop), np.bool_(preview), np.int32(next_report)


STEP_HOOK = StepHook()  # the process's one step hook: every program with step_hook calls it
