"""SIGTERM/SIGINT for the whole process: a clean stop, from the first line of ``python app.py`` on.

Standard library only, so the process installs it before any heavy import (serving.main.prepare).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from sdxl_engine.serving import logs  # standard library only

LOG = logging.getLogger(__name__)


class StopSignals:
    """SIGTERM/SIGINT for :func:`~.server.serve`: the first asks for a stop, the second is ignored, the third exits.

    The handler only appends to a list (one atomic step, no lock): Python runs signal handlers in
    the main thread between two bytecodes, even inside a handler or while that thread holds a
    lock, so a handler that takes a lock (``threading.Event.set`` takes its Condition's) can wait
    for ever on the thread it interrupted. The serving loop polls :attr:`requested` instead.

    - 1st signal: :func:`~.server.serve` drains and exits 0. Signals within ``BURST_S`` of the first count
      as the same stop: GNU ``timeout`` sends two SIGTERMs at once (to the child, then to its
      process group), which the kernel sometimes merges into one; either way it is one stop, so
      what the user sends next always counts the same.
    - 2nd: ignored; :meth:`note_ignored` logs it once.
    - 3rd: one line on stderr (formatted as the log's), then ``os._exit(128 + signal number)`` (143 for
      SIGTERM, 130 for SIGINT, as a shell reports a process the signal ended), dropping the calls still running.

    Install it as early as the process can (serving.main.prepare does, before Gradio, JAX or any other
    heavy import): a signal before :func:`~.server.serve` then still ends in a clean stop, never in the
    default kill (exit 143 without a word) or a KeyboardInterrupt traceback.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    BURST_S = 0.25  # far above the microseconds between timeout's two signals, below a person's repeat

    def __init__(self):
        self.received: list[int] = []  # list.append is atomic, so nested handlers count every signal
        self._first_at: float | None = None  # time.monotonic() of the first signal
        self._noted = False

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (call from the main thread)."""
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        elif now - self._first_at < self.BURST_S:
            return  # part of the first stop's burst
        self.received.append(signum)
        if len(self.received) >= 3:
            name = signal.Signals(signum).name
            # Written directly: the logging module takes locks, which the interrupted code may hold.
            os.write(2, (logs.line(logging.WARNING, __name__, f"[app] {name} a third time: exiting at once, without "
                                   f"finishing the calls still running (exit status {128 + signum})") + "\n").encode())
            os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return bool(self.received)

    def note_ignored(self, log=LOG.info) -> None:
        """Log, once, that a second signal was ignored (called by the loop, never by the handler)."""
        if len(self.received) >= 2 and not self._noted:
            self._noted = True
            log("[app] second stop signal ignored: already stopping (a third one exits at once)")
