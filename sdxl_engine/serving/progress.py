"""Progress, interrupt and skip of each request, addressed by its id and read by its owner.

A request (:class:`Job`) is one client's ask: the page's Generate, a gradio_client call, or one
AUTOMATIC1111 / OpenAI request, which may run several engine calls (16 images = 4 calls). The handler
writes a job's progress as its calls run; a protocol reads and stops only the jobs of its own
:data:`Owner`, so A1111's ``/progress``, ``/interrupt`` and ``/skip`` see and stop the caller's own
A1111 requests (same client address), never a page's, a gradio_client's or another address's. With
``--replicas N`` several jobs run at once, each with its own record and stop flags. Thread-safe:
Gradio's workers, the API routes and the devices' callback thread all call it. No Gradio import.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading

import numpy as np

from sdxl_engine.engine.contract import clock
from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.service.images import png_bytes

Owner = tuple[str, str]  # (protocol, client): ("a1111", "127.0.0.1"), ("page", <Gradio session>) ...


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One job as its owner sees it; ``job`` None = the owner has none running.

    ``call``/``calls``: the engine call running (0-based) and how many the job makes; ``step``/``steps``:
    denoising steps done / to run in that call (0/0 before its loop starts); ``stage``: the engine's stage
    name (handler.STAGES); ``started``: contract.clock() when the job opened; ``eta_s``: seconds left in
    the job, estimated from its steps so far (None until a step has run); ``preview``: the latest preview
    as PNG bytes, the batch in one grid (previews.preview_grid; None: none yet or previews off);
    ``interrupted``/``skipped``: a stop of the whole job / of its running call was asked.
    """

    job: str | None = None
    stage: str = ""
    call: int = 0
    calls: int = 0
    step: int = 0
    steps: int = 0
    started: float | None = None
    eta_s: float | None = None
    preview: bytes | None = None
    interrupted: bool = False
    skipped: bool = False

    @property
    def fraction(self) -> float:
        """0..1: the share of the job's denoising done, its earlier calls counted whole (0 when idle)."""
        if not self.calls:
            return 0.0
        return (self.call + (self.step / self.steps if self.steps else 0.0)) / self.calls


@dataclasses.dataclass
class Job:
    """A job's mutable record, held by :class:`Jobs` under its lock (read it through :meth:`Jobs.snapshot`)."""

    owner: Owner
    now: Snapshot
    interrupted: threading.Event = dataclasses.field(default_factory=threading.Event)
    skipped: threading.Event = dataclasses.field(default_factory=threading.Event)
    calls_begun: int = 0
    loop_started: float | None = None  # clock() when the running call's denoising loop began
    done_s: float = 0.0  # seconds the finished calls' loops took (the eta of the calls still to come)
    preview_image: np.ndarray | None = None  # the latest array preview, PNG-encoded when read
    pngs: list[bytes] = dataclasses.field(default_factory=list)  # the last finished call's PNGs, until taken


class Jobs:
    """Every open job by id (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}

    def open(self, owner: Owner, calls: int = 1) -> str:
        """A job of ``calls`` engine calls opens for ``owner``; returns its id (unguessable)."""
        job_id = secrets.token_hex(8)
        with self._lock:
            self._jobs[job_id] = Job(owner, Snapshot(job=job_id, calls=max(1, calls), started=clock()))
        return job_id

    def close(self, job_id: str) -> None:
        """The job finished, failed or stopped: it is forgotten."""
        with self._lock:
            self._jobs.pop(job_id, None)

    def begin_call(self, job_id: str, steps: int) -> None:
        """The job's next engine call starts on the engine (``steps`` denoising steps); a skip of the
        previous call is cleared."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            job.skipped.clear()
            job.calls_begun += 1
            job.loop_started, job.preview_image = None, None
            job.now = dataclasses.replace(job.now, call=min(job.calls_begun - 1, job.now.calls - 1), step=0,
                                          steps=steps, stage="", preview=None, skipped=False)

    def end_call(self, job_id: str) -> None:
        """The running call left the engine (its loop time counts towards the next calls' estimate)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.loop_started is not None:
                job.done_s += clock() - job.loop_started
                job.loop_started = None

    def stage(self, job_id: str, stage: str) -> None:
        """The running call's engine stage changed (ignored for a closed job)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None:
                job.now = dataclasses.replace(job.now, stage=stage)
                if stage == "on device" and job.loop_started is None:
                    job.loop_started = clock()

    def step(self, job_id: str, step: int, steps: int, preview: bytes | np.ndarray | None = None) -> None:
        """Denoising step ``step`` of ``steps`` of the running call finished (1-based); ``preview`` replaces
        the last one if given: PNG bytes, or the batch's previews as (b, h, w, 3) uint8 (or one (h, w, 3)
        image), which become one PNG (their grid) only when a snapshot is taken (this runs on the devices'
        callback thread, which must not wait for an encode). Ignored for a closed job."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            now = clock()
            if job.loop_started is None:
                job.loop_started = now
            per_step = (now - job.loop_started) / step if step > 0 else None
            calls_left = job.now.calls - 1 - job.now.call
            eta = None if per_step is None else per_step * (steps - step) + per_step * steps * calls_left
            if isinstance(preview, np.ndarray):
                job.preview_image, preview = preview, None
            job.now = dataclasses.replace(job.now, step=step, steps=steps, eta_s=eta,
                                          preview=preview if preview is not None else job.now.preview)

    def snapshot(self, owner: Owner) -> Snapshot:
        """The record of ``owner``'s most recently opened job (Snapshot() when it has none)."""
        with self._lock:
            owned = [job for job in self._jobs.values() if job.owner == owner]
            if not owned:
                return Snapshot()
            job = max(owned, key=lambda j: j.now.started)
            if job.preview_image is not None:  # the latest array preview, encoded once
                job.now = dataclasses.replace(job.now, preview=png_bytes(preview_grid(job.preview_image)))
                job.preview_image = None
            return dataclasses.replace(job.now, interrupted=job.interrupted.is_set(), skipped=job.skipped.is_set())

    def interrupt(self, owner: Owner) -> bool:
        """Stop every job of ``owner`` after its running step, and its calls still to come; False when it has none."""
        return self._flag(owner, "interrupted")

    def cancel(self, job_id: str) -> None:
        """Stop the job ``job_id`` after its running step, and its calls still to come (its client has gone)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None:
                job.interrupted.set()

    def skip(self, owner: Owner) -> bool:
        """Stop the running call of every job of ``owner`` after its running step; the job's later calls still
        run (A1111's skip ends the current batch). False when it has none."""
        return self._flag(owner, "skipped")

    def _flag(self, owner: Owner, which: str) -> bool:
        with self._lock:
            owned = [job for job in self._jobs.values() if job.owner == owner]
            for job in owned:
                getattr(job, which).set()
            return bool(owned)

    def deliver(self, job_id: str, pngs: list[bytes]) -> None:
        """The job's running call made ``pngs`` (PNG bytes, as delivered: image i of its seeds), kept in memory
        for the request service (service.RequestService.run: the answer's bytes, no read back from disk) until
        :meth:`take_pngs`. Ignored for a closed job."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None:
                job.pngs = list(pngs)

    def take_pngs(self, job_id: str) -> list[bytes]:
        """The PNGs :meth:`deliver` kept for the job's last call, handed over once ([] when none)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return []
            pngs, job.pngs = job.pngs, []
            return pngs

    def stop_requested(self, job_id: str) -> bool:
        """Whether the job's running call is to stop: the job was interrupted or the call skipped."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and (job.interrupted.is_set() or job.skipped.is_set())

    def interrupted(self, job_id: str) -> bool:
        """Whether the whole job was interrupted (its calls still to come are not to run)."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and job.interrupted.is_set()

    def running(self) -> int:
        """How many jobs are open."""
        with self._lock:
            return len(self._jobs)


JOBS = Jobs()  # the served process's open jobs, by id
