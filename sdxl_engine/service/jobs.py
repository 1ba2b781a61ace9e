"""Jobs: one request's life in the service, by id, followed by its owner.

A :class:`Job` is made by :meth:`Service.submit <sdxl_engine.service.service.Service.submit>` and lives until its
result is evicted (:class:`JobStore`). It carries everything a request's run needs that used to be process-wide: its
progress (call k of n, step k of N, the latest preview), its stop flags (cancel: the whole job; skip: the running
engine call, A1111's ``/skip``), its events in order (:data:`EVENTS`) for whoever follows it (the page's stream,
``GET /v1/jobs/{id}/events``, A1111's ``/internal/progress``) and its result: images as arrays, PNG bytes encoded
once, seeds and the info record. Thread-safe: the service's workers, XLA's callback thread and the fronts' event
loops all touch it. No Gradio, no HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import threading

import numpy as np

from sdxl_engine.engine.contract import clock
from sdxl_engine.service.request import Request

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINAL = (SUCCEEDED, FAILED, CANCELLED)
EVENTS = ("queued", "started", "stage", "step", "preview", SUCCEEDED, FAILED, CANCELLED)
"""The names of a job's events, in the order they can come: ``queued`` (data ``{"position"}``, again whenever
its place in line changes), ``started``, ``stage`` (``{"stage"}``: the engine's stage: compiling, waiting,
preparing, on device, to host; also ``loading`` while the engine starts), ``step`` (``{"step", "steps", "call",
"calls"}``, one for every step, however the engine batches its reports), ``preview`` (``{"step", "steps"}``:
:attr:`Job.preview` holds the image), then one of ``succeeded``,
``failed``, ``cancelled`` (data None: read the job)."""


class JobNotFound(LookupError):
    """No job with this id for this owner (another owner's job is not found either)."""


class JobGone(LookupError):
    """The job finished and its result was dropped (older than the store keeps, or pushed out by newer ones)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished job's images.

    ``images``: (n, H, W, 3) uint8, as the client receives them (pasted back); ``pngs``: the same as PNG bytes
    with A1111's ``parameters`` chunk (service/delivery.py), encoded once; ``seeds``: image i's seed; ``info``: the
    first engine call's info record (docs/python.md) with every image's ``seeds``; ``warnings``: for the user
    (a prompt cut, a save that failed); ``stems``: file names without ``.png`` (``seed42-a-red-circle``), for
    fronts that write files; ``stopped``: None, or the message of the interrupt that ended the job before all its
    calls ran (the images are those made until then)."""

    images: np.ndarray
    pngs: list[bytes]
    seeds: list[int]
    info: dict
    warnings: list[str]
    stems: list[str]
    stopped: str | None = None

    @property
    def nbytes(self) -> int:
        """Memory the result holds (arrays and PNGs), for the store's bound."""
        return int(self.images.nbytes) + sum(len(png) for png in self.pngs)


class Job:
    """One request in the service (see the module docstring). Read its fields; only the service writes them.

    Attributes:
        id: unguessable (16 hex digits), or the client's own (A1111's ``force_task_id``).
        owner: who may see and stop it: the API key where one is set, else the client's address.
        client: whom the per-client cap counts it against (the client's address).
        front: which front made it ("page", "a1111", "openai", "mcp", "jobs"), for fronts that list their own.
        request: what it runs (request.Request).
        status: queued, running, succeeded, failed or cancelled.
        position: its place in line while queued (0 = next), else None.
        call, calls: the engine call running (0-based) and how many the job makes; step, steps: denoising steps
            done / to run in that call; stage: the engine's stage now.
        preview: the latest preview ((b, h, w, 3) uint8, the batch at latent resolution) or None.
        result: the Result once succeeded (or cancelled after some images); stopped: the message of the stop that
            ended its last engine call early, if one did; error: the typed error once failed
            (engine.errors' InvalidRequest, EngineNotReady, GenerationError, CompilesBusy; another exception
            is an internal failure, logged with its traceback by the service).
        created, started, finished: contract.clock() times (None until then).
    """

    def __init__(self, owner: str, front: str, request: Request, calls: int, job_id: str | None = None,
                 arrived: float | None = None, client: str | None = None):
        self.id = job_id or secrets.token_hex(8)
        self.owner = owner
        self.client = owner if client is None else client
        self.front = front
        self.request = request
        self.status = QUEUED
        self.position: int | None = None
        self.call, self.calls, self.step, self.steps, self.stage = 0, calls, 0, 0, ""
        self.preview: np.ndarray | None = None
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.stopped: str | None = None  # how a stop ended it ("the request was stopped after step 3 of 8")
        self.created = clock()
        self.arrived = self.created if arrived is None else arrived
        self.started: float | None = None
        self.finished: float | None = None
        self.loop_started: float | None = None  # clock() when the running call's denoising loop began
        self.cancelled = threading.Event()  # the whole job is to stop (DELETE, the page's Stop, A1111's interrupt)
        self.stop_reason = "cancelled"  # what stopped it, for its log line (Service.stop)
        self.skipped = threading.Event()  # the running engine call is to stop; the next one runs (A1111's skip)
        self._events: list[tuple[str, dict | None]] = []
        self._cond = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # ---- reading -------------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.status in FINAL

    @property
    def fraction(self) -> float:
        """0..1: the share of the job's denoising done, its earlier calls counted whole."""
        if self.status == SUCCEEDED:
            return 1.0
        return (self.call + (self.step / self.steps if self.steps else 0.0)) / max(1, self.calls)

    @property
    def eta_s(self) -> float | None:
        """Seconds left, estimated from the steps so far (None until a step has run)."""
        if self.loop_started is None or not self.step:
            return None
        per_step = (clock() - self.loop_started) / self.step
        return per_step * (self.steps - self.step) + per_step * self.steps * (self.calls - 1 - self.call)

    def events(self, start: int = 0) -> list[tuple[str, dict | None]]:
        """The job's events from index ``start`` on, as (name, data) (:data:`EVENTS`)."""
        with self._cond:
            return self._events[start:]

    def wait(self, start: int, timeout: float | None = None) -> list[tuple[str, dict | None]]:
        """:meth:`events` from ``start``, waiting up to ``timeout`` seconds for one when there are none yet."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._events) > start, timeout)
            return self._events[start:]

    async def next_events(self, start: int, timeout: float | None = None) -> list[tuple[str, dict | None]]:
        """:meth:`wait` for a coroutine: waits without a thread (woken by the service's thread that adds one)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        waiter = (loop, ready)
        with self._cond:
            if len(self._events) > start:
                return self._events[start:]
            self._waiters.add(waiter)
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._cond:
                self._waiters.discard(waiter)
        return self.events(start)

    async def finished_result(self) -> Job:
        """Wait (without a thread) until the job has finished; returns it."""
        seen = 0
        while not self.done:
            seen = len(await self.next_events(seen, timeout=1.0)) + seen
        return self

    # ---- writing (the service) -----------------------------------------------------------------------------------
    def emit(self, name: str, data: dict | None = None) -> None:
        """Add an event and wake whoever follows the job."""
        with self._cond:
            self._events.append((name, data))
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, ready in waiters:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the follower's loop has closed: it follows no more
                pass

    def stop_requested(self) -> bool:
        """Whether the running engine call is to stop (the job cancelled or the call skipped)."""
        return self.cancelled.is_set() or self.skipped.is_set()


class JobStore:
    """The jobs by id: every open one, and finished ones for ``keep_s`` seconds, at most ``keep_bytes`` of results
    (the oldest finished dropped first); ids of dropped jobs are remembered (up to ``remember``) so a late reader
    learns they are gone (:class:`JobGone`) rather than unknown."""

    def __init__(self, keep_s: float = 600.0, keep_bytes: int = 512 << 20, remember: int = 10_000):
        self.keep_s = keep_s
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> owner
        self._remember = remember

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job
        self.evict()

    def taken(self, job_id: str) -> bool:
        """Whether ``job_id`` names a job now or once (a client's own id must be new)."""
        with self._lock:
            return job_id in self._jobs or job_id in self._gone

    def get(self, job_id: str, owner: str | None) -> Job:
        """The job ``job_id`` of ``owner`` (None: any owner's, for the server itself).

        Raises JobNotFound (no such job, or another owner's), JobGone (the owner's, dropped)."""
        self.evict()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and (owner is None or job.owner == owner):
                return job
            if job is None and job_id in self._gone and (owner is None or self._gone[job_id] == owner):
                raise JobGone(job_id)
        raise JobNotFound(job_id)

    def of(self, owner: str | None, front: str | None = None) -> list[Job]:
        """``owner``'s jobs (None: everyone's), newest first, only ``front``'s if given."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if (owner is None or j.owner == owner)
                    and (front is None or j.front == front)]
        return sorted(jobs, key=lambda j: j.created, reverse=True)

    def evict(self) -> None:
        """Drop finished jobs older than ``keep_s``, then the oldest finished ones past ``keep_bytes``."""
        now = clock()
        with self._lock:
            finished = sorted((j for j in self._jobs.values() if j.done), key=lambda j: j.finished or 0)
            held = sum(j.result.nbytes for j in finished if j.result is not None)
            for job in finished:
                old = now - (job.finished or now) > self.keep_s
                if not old and held <= self.keep_bytes:
                    continue
                held -= job.result.nbytes if job.result is not None else 0
                del self._jobs[job.id]
                self._gone[job.id] = job.owner
                while len(self._gone) > self._remember:
                    self._gone.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

