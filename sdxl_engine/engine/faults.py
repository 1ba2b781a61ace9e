"""TEST-ONLY fault injection; off unless ``SDXL_FAULT_INJECTION=1`` is in the environment.

The reliability tests need an engine that fails, slows down or produces NaN on demand, inside
a real ``python app.py`` process. With the switch on (read once, when the engine is built, which
then holds an :class:`Injector`), a prompt containing one of these markers triggers a fault inside
the engine, on the request's own thread, for that request only:

==================  ==========================================================================
marker              effect
==================  ==========================================================================
``fault:raise``     raise :class:`InjectedFault` after the program ran (an unexpected bug)
``fault:slow=S``    sleep S seconds (0 < S <= 60) on the device stage, before the program runs:
                    simulated device time (a long generation), reported and timed as ``device``
``fault:nan``       run the program with NaN VAE weights, so it really returns non-finite pixels
``fault:hold=NAME`` on the device stage, before the program runs, wait until a file ``NAME``
                    (letters, digits, ``-``, ``_``) exists in ``SDXL_FAULT_HOLD_DIR``: a generation
                    that lasts exactly until the test releases it (at most 120 s, then
                    :class:`InjectedFault`), so tests wait on conditions, not on durations
==================  ==========================================================================

With the switch on, ``SDXL_FAULT_START_DELAY=S`` (0 < S <= 60) also makes the engine's start
take S seconds longer (in its "loading model" stage), so a test can watch the page while the
engine starts, however fast the machine.

With the switch off (the default, and always in production) the engine holds no injector (None):
markers are ordinary prompt text, the delay is ignored, and a request pays one ``if`` per stage.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import jax
import numpy as np

ENV = "SDXL_FAULT_INJECTION"
START_DELAY_ENV = "SDXL_FAULT_START_DELAY"
HOLD_DIR_ENV = "SDXL_FAULT_HOLD_DIR"
HOLD_LIMIT_S = 120.0
_SLOW = re.compile(r"fault:slow=(\d+(?:\.\d+)?)")
_HOLD = re.compile(r"fault:hold=([A-Za-z0-9_-]+)")


class InjectedFault(RuntimeError):
    """The failure asked for by ``fault:raise``."""


def enabled(environ=None) -> bool:
    """Whether the test-only switch is on (``SDXL_FAULT_INJECTION`` is 1/true/yes/on)."""
    return (os.environ if environ is None else environ).get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def slow_seconds(prompt: str) -> float:
    """Seconds asked for by ``fault:slow=S`` in ``prompt`` (0 if absent), capped at 60."""
    match = _SLOW.search(prompt)
    return min(float(match.group(1)), 60.0) if match else 0.0


def wants(prompt: str, name: str) -> bool:
    """Whether ``prompt`` carries the marker ``fault:<name>`` (``raise`` or ``nan``)."""
    return f"fault:{name}" in prompt


def start_delay(environ=None) -> float:
    """Seconds asked for by ``SDXL_FAULT_START_DELAY`` (0 if unset or not a number), capped at 60."""
    try:
        return min(max(float((os.environ if environ is None else environ).get(START_DELAY_ENV, "0")), 0.0), 60.0)
    except ValueError:
        return 0.0


def device_delay(prompt: str, environ=None) -> None:
    """The simulated device time a prompt asks for: ``fault:slow=S`` sleeps S seconds, then
    ``fault:hold=NAME`` creates ``$SDXL_FAULT_HOLD_DIR/NAME.held`` (the hold has begun), then waits until
    ``$SDXL_FAULT_HOLD_DIR/NAME`` exists (polled every 20 ms).

    Raises:
        InjectedFault: a hold not released within :data:`HOLD_LIMIT_S` seconds, or with no
            ``SDXL_FAULT_HOLD_DIR`` set (a test that forgot it must not hang a server).
    """
    time.sleep(slow_seconds(prompt))
    match = _HOLD.search(prompt)
    if not match:
        return
    folder = (os.environ if environ is None else environ).get(HOLD_DIR_ENV, "")
    if not folder:
        raise InjectedFault(f"fault:hold needs {HOLD_DIR_ENV} (a folder the test creates release files in)")
    release, deadline = Path(folder) / match.group(1), time.monotonic() + HOLD_LIMIT_S
    (Path(folder) / f"{match.group(1)}.held").touch()  # tells a test the generation is on the device, held
    while not release.exists():
        if time.monotonic() > deadline:
            raise InjectedFault(f"fault:hold={match.group(1)} was not released within {HOLD_LIMIT_S:g} s")
        time.sleep(0.02)


class Injector:
    """The engine's test-only faults: one hook per stage of a request (and one at start-up).

    Made by :func:`injector` only when the switch is on; the engine calls a hook only when it
    holds one, so production requests never reach this code.
    """

    def __init__(self, environ=None):
        self.environ = environ  # None: os.environ, read when each hook runs

    def on_start(self) -> None:
        """The "loading model" stage: sleep ``SDXL_FAULT_START_DELAY`` seconds."""
        time.sleep(start_delay(self.environ))

    def params(self, prompt: str, params: dict) -> dict:
        """The parameters to run ``prompt`` with: ``fault:nan`` gets NaN VAE weights (this request only)."""
        if wants(prompt, "nan"):
            return {**params, "vae": jax.tree.map(lambda x: x * np.nan, params["vae"])}
        return params

    def on_device(self, prompt: str) -> None:
        """Before the program runs, counted as device time: ``fault:slow`` and ``fault:hold`` (:func:`device_delay`)."""
        device_delay(prompt, self.environ)

    def after_run(self, prompt: str) -> None:
        """After the program ran: ``fault:raise`` raises :class:`InjectedFault`."""
        if wants(prompt, "raise"):
            raise InjectedFault("injected fault (fault:raise) in the middle of a request")


def injector(environ=None) -> Injector | None:
    """An :class:`Injector` when the test-only switch is on (:func:`enabled`), else None."""
    return Injector(environ) if enabled(environ) else None
