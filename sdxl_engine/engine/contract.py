"""The contract between the page (and its request handler) and any engine.

:class:`EngineContract` names everything ``app.py`` and ``sdxl_engine.serving.handler`` may use
of an engine. Two classes implement it: the local :class:`~sdxl_engine.engine.local.Engine` (one
per process, on this host's devices) and the Ray front
:class:`~sdxl_engine.serving.remote.RemoteEngine` (Serve replicas, each an Engine). Anything
the page needs from an engine is added here first, then to both; the page never probes an
engine with ``getattr``/``hasattr``.

Request timings use one clock, :func:`clock` (``time.perf_counter``), from the HTTP guard's
arrival stamp to the engine's stages, and one queue formula, :func:`queue_seconds`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Protocol, runtime_checkable

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.validation import GenerateRequest, Limits


def clock() -> float:
    """Seconds on the one clock of request timings (``time.perf_counter``: monotonic, this process only).

    The HTTP guard stamps a request's arrival with it (serving.guard.arrival_time reads it back)
    and the engines time their stages with it, so an arrival needs no conversion.
    """
    return time.perf_counter()


def queue_seconds(arrived: float | None, called: float, started: float) -> float:
    """Seconds a request waited before its work started, on :func:`clock`.

    ``arrived``: when it reached the server (None: unknown, so the wait starts at ``called``);
    ``called``: when the engine's ``generate`` was called; ``started``: when its work started (the
    local engine: after validation; the Ray front: when it was sent to a replica). An arrival
    stamped after ``called`` (another clock's value) counts from ``called``; never negative.
    """
    return max(0.0, started - (called if arrived is None else min(arrived, called)))


@runtime_checkable
class ModelDescription(Protocol):
    """What the page shows of the loaded model."""

    name: str  # e.g. "tiny-shapes" or a hub id
    dtype: object  # the parameters' storage dtype (a numpy/JAX dtype or its name); shown with str()


@dataclasses.dataclass(frozen=True)
class ScaleOut:
    """What the page shows of a scaled-out engine (None from :meth:`EngineContract.scale_out` for one engine).

    Attributes:
        text: the replica counts, e.g. ``2 of 2 replicas ready`` or ``1 replica ready (autoscaling 1-4), 1 starting``.
        settled: whether the deployment has as many replicas as it wants (the banner stops refreshing).
    """

    text: str
    settled: bool


@runtime_checkable
class EngineContract(Protocol):
    """What the page and its request handler may use of an engine (both engines implement it).

    Start state: ``ready`` (set once start-up finished, well or not), ``error`` (None, or why the
    start failed), ``stage`` (what start-up is doing now, for the banner), ``started``
    (:func:`clock` at construction), ``startup`` (start-up stages in seconds; ``ready_s`` once
    ready). Set at start (None or empty before ``ready``): ``limits``, ``batch`` (images per
    request), ``device_summary`` (e.g. ``4 × cpu``), ``model``. ``config`` is the engine's
    settings as given; ``defaults`` the same with the model's engine_defaults.json applied
    (config.resolve_defaults; equal to ``config`` until the model is known).
    """

    ready: threading.Event
    error: BaseException | None
    stage: str
    started: float
    startup: dict[str, float]
    config: EngineConfig
    defaults: EngineConfig
    limits: Limits | None
    batch: int | None
    device_summary: str
    model: ModelDescription | None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until start-up finished. Raises EngineNotReady if it failed or timed out."""

    def generate(self, request: GenerateRequest, ready_timeout: float | None = None,
                 progress: Callable[[str], None] | None = None, arrived: float | None = None,
                 on_step: Callable | None = None, should_stop: Callable[[], bool] | None = None):
        """Validate and run one request; returns a GenerateResult (engine.local).

        ``progress(stage)`` hears each stage as it starts; ``arrived`` (:func:`clock` when the request
        reached the server) is where ``timings["queue"]`` starts (:func:`queue_seconds`).
        ``on_step(engine.steps.StepEvent)`` hears each denoising step an engine reports (with its
        previews); ``should_stop()`` True stops the request as soon as the engine can, raising
        engine.steps.Stopped.

        Raises InvalidRequest (a bad argument), EngineNotReady, GenerationError (an unusable
        image, a lost replica).
        """

    def scale_out(self) -> ScaleOut | None:
        """None for one engine in this process; else the replica counts as the page shows them."""
