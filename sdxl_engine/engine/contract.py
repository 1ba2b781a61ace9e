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
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.errors import EngineNotReady
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


@dataclasses.dataclass
class GenerateResult:
    """One request's output.

    Attributes:
        images: (batch, height, width, 3) uint8, channels-last, RGB.
        seeds: seed of each image (request seed + i, wrapping to 0 past max_seed); any image is
            reproduced by its seed alone as the first image of a request with that seed.
        request: the validated request (defaults filled, random seed resolved).
        timings: seconds: ``queue`` (from arrival until this request started), ``prep``
            (compile if new, tokenize, schedule), ``device`` (the compiled program, until
            ready), ``post`` (to host), ``latency`` (prep + device + post: the engine's time,
            queue excluded).
        warnings: things the user should know (a prompt cut at ``max_prompt_chunks`` chunks, a
            weight clamped; words the model was not trained on, for models that ship their vocabulary).
        device_count: devices the batch was split over.
        device_summary: e.g. ``4 × cpu``.
        model: the loaded model's name.
        prompt_chunks: 75-token chunks the prompt and negative prompt ran with (the program's ``chunks``).
        loras: {name: A1111 short hash} of the LoRAs the prompt's tags named, in their order.
        refiner: the refiner's name when it ran (``request.refiner_switch_at``), else "".
        control_infotext: A1111's infotext entries of the request's ControlNet units, {"ControlNet 0": "Module:
            canny, Model: name [hash], Weight: 1.0, ..."} (engine/control.py ``infotext``), then its IP-Adapter
            units' as sd-webui-controlnet writes them, numbered on ("Module: ip-adapter_clip_sdxl, ...":
            engine/ip_adapter.py ``infotext``); the values hold commas, so a PNG's parameters quote them (JSON)
            as A1111 does. {} without units.
    """

    images: np.ndarray
    seeds: list[int]
    request: GenerateRequest
    timings: dict[str, float]
    warnings: list[str]
    device_count: int
    device_summary: str
    model: str
    prompt_chunks: int = 1
    loras: dict[str, str] = dataclasses.field(default_factory=dict)
    refiner: str = ""
    control_infotext: dict[str, str] = dataclasses.field(default_factory=dict)


def wait_for_start(engine, timeout: float | None) -> None:
    """Block until ``engine.ready`` (a threading.Event) is set, up to ``timeout`` seconds (None: no limit).

    Raises EngineNotReady naming ``engine.stage`` on a timeout, or ``engine.error`` if the start failed.
    """
    if not engine.ready.wait(timeout):
        raise EngineNotReady(f"the engine is still {engine.stage} after {timeout} s")
    if engine.error is not None:
        raise EngineNotReady(f"the engine failed to start: {engine.error}")


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
        """Validate and run one request; returns a :class:`GenerateResult`.

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
