"""TEST-ONLY fault injection; off unless ``SDXL_FAULT_INJECTION=1`` is in the environment.

The reliability tests need an engine that fails, slows down or produces NaN on demand, inside
a real ``python app.py`` process. With the switch on (read once, when the engine is built), a
prompt containing one of these markers triggers a fault inside the engine, while it holds the
device lock, for that request only:

==================  ==========================================================================
marker              effect
==================  ==========================================================================
``fault:raise``     raise :class:`InjectedFault` after the program ran (an unexpected bug)
``fault:slow=S``    sleep S seconds (0 < S <= 60) on the device stage, before the program runs:
                    simulated device time (a long generation), reported and timed as ``device``
``fault:nan``       run the program with NaN VAE weights, so it really returns non-finite pixels
==================  ==========================================================================

With the switch on, ``SDXL_FAULT_START_DELAY=S`` (0 < S <= 60) also makes the engine's start
take S seconds longer (in its "loading model" stage), so a test can watch the page while the
engine starts, however fast the machine.

With the switch off (the default, and always in production) markers are ordinary prompt text
and the delay is ignored.
"""

from __future__ import annotations

import os
import re

ENV = "SDXL_FAULT_INJECTION"
START_DELAY_ENV = "SDXL_FAULT_START_DELAY"
_SLOW = re.compile(r"fault:slow=(\d+(?:\.\d+)?)")


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
