"""Waiting for the engine's start: its stage or its error."""

import threading
from types import SimpleNamespace

import pytest

from sdxl_engine.engine.contract import wait_for_start
from sdxl_engine.engine.errors import EngineNotReady


def test_waiting_for_the_engine_names_its_stage_or_its_error():
    starting = SimpleNamespace(ready=threading.Event(), stage="compiling 64x64", error=None)
    with pytest.raises(EngineNotReady, match=r"^the engine is still compiling 64x64 after 0.01 s$"):
        wait_for_start(starting, 0.01)
    starting.ready.set()
    wait_for_start(starting, 0.01)  # ready: returns
    failed = SimpleNamespace(ready=threading.Event(), stage="failed", error=ValueError("no such model"))
    failed.ready.set()
    with pytest.raises(EngineNotReady, match=r"^the engine failed to start: no such model$"):
        wait_for_start(failed, None)
