"""Stop signals without a server process: one burst is one stop; a signal before serve is a clean stop."""

import os
import signal
import time

from sdxl_engine.serving.server import StopSignals, serve


def test_signals_of_one_burst_are_one_stop(monkeypatch):
    """GNU timeout's two SIGTERMs (merged by the kernel or not) are one stop, so the user's next
    signal is always the second (ignored, one line) and the one after it exits at once."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    exits = []
    monkeypatch.setattr(os, "_exit", lambda status: exits.append(status))
    signals, lines = StopSignals(), []
    signals._handle(signal.SIGTERM, None)
    clock[0] += 20e-6  # timeout's second signal, to the process group
    signals._handle(signal.SIGTERM, None)
    assert signals.requested and len(signals.received) == 1
    signals.note_ignored(lines.append)
    assert lines == [] and exits == []
    clock[0] += 5.0  # the user's next one
    signals._handle(signal.SIGTERM, None)
    signals.note_ignored(lines.append)
    assert lines == ["[app] second stop signal ignored: already stopping (a third one exits at once)"]
    assert exits == []
    clock[0] += 5.0
    signals._handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_a_signal_before_the_server_starts_is_a_clean_stop():
    """app.main installs the handlers before the engine starts: a stop signal while the process
    starts (before serve) ends in the stop's two lines and status 0, not the default kill (143)."""
    signals, lines = StopSignals(), []
    signals.received.append(signal.SIGTERM)
    assert serve(None, None, {}, None, log=lines.append, signals=signals) == 0
    assert lines == ["[app] stopping: a stop signal came before the server started", "[app] stopped"]
