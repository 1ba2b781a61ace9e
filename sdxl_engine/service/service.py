"""The service: every request of every front, in one line in front of the engine.

:meth:`Service.submit` admits a request (the per-client cap for every front together, the waiting bound, the
shutdown), validates it with the engine's rules, and queues it as a :class:`~sdxl_engine.service.jobs.Job`; ``slots``
worker threads take jobs in order of arrival and run their engine calls (``engine.generate``, the local engine or
the Ray front), each with the job's own step hook and stop flags; the results come back as arrays and PNG bytes
encoded once (delivery.py), saved to ``outputs_dir`` when the operator asks. Fronts follow a job by its events
(jobs.EVENTS) and stop it with :meth:`cancel` / :meth:`skip`. It raises the engine's typed errors and its own
:class:`Refused`; it knows no Gradio and no HTTP.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading

import numpy as np

from sdxl_engine.engine.contract import EngineContract, clock
from sdxl_engine.engine.errors import CompilesBusy, EngineNotReady, GenerationError, InvalidRequest
from sdxl_engine.engine.steps import StepEvent, Stopped
from sdxl_engine.engine.validation import validate
from sdxl_engine.service import delivery, models
from sdxl_engine.service.jobs import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, Job, JobStore, Result
from sdxl_engine.service.request import MAX_CALLS, Request

LOG = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a refused client is told to wait (Retry-After) before it asks again
SHUTTING_DOWN = "the server is shutting down; retry in a minute"
EXPECTED = (InvalidRequest, EngineNotReady, GenerationError, CompilesBusy)  # a request's failures with a message


class Refused(Exception):
    """The service did not take a request: ``status`` 429 (the client's cap) or 503 (shutting down, or the line
    is full), ``message`` for the client, ``retry_after_s`` for its ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after_s: int):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


def over_limit_message(limit: int) -> str:
    """What a client over its cap is told."""
    return (f"too many requests from this client: at most {limit} may be queued or running at once "
            f"(max_requests_per_client = {limit}); retry when one has finished")


class Service:
    """See the module docstring.

    Args:
        engine: the engine contract (local or the Ray front).
        slots: engine calls at once (one worker thread each): 1 locally (compiles of new sizes run beside it), one
            per replica with ``--replicas``.
        limit: a client's requests queued or running at once (``max_requests_per_client``), all fronts together.
        max_waiting: requests that may wait at once (``max_queue_size``); None = no bound.
        outputs_dir: also save every image a client receives here ("" = no).
        store: where jobs are kept (JobStore: finished ones for a bounded time and memory).
    """

    def __init__(self, engine: EngineContract, slots: int = 1, limit: int = 4, max_waiting: int | None = None,
                 outputs_dir: str = "", store: JobStore | None = None):
        if slots < 1:
            raise ValueError(f"a service needs at least one slot, got {slots}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.engine = engine
        self.slots = slots
        self.limit = limit
        self.max_waiting = max_waiting
        self.outputs_dir = outputs_dir
        self.store = store if store is not None else JobStore()
        self.closed = False
        self._cond = threading.Condition()
        self._line: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._workers = [threading.Thread(target=self._work, name=f"service-slot-{i}", daemon=True)
                         for i in range(slots)]
        # PNGs are encoded here, one job at a time, so a slot is free for the next job's engine calls meanwhile
        self._encoder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="service-encoder")
        for worker in self._workers:
            worker.start()

    # ---- what fronts call ----------------------------------------------------------------------------------------
    def submit(self, request: Request, owner: str, front: str, job_id: str | None = None, client: str | None = None,
               arrived: float | None = None) -> Job:
        """Queue ``request`` for ``owner`` (who may follow and stop it: an API key, or the client's address) from
        ``front``; returns its Job at once (status queued). ``job_id``: the client's own id (A1111's
        ``force_task_id``), else a new one. ``client``: who the per-client cap counts it against (the client's
        address; default ``owner``). ``arrived``: contract.clock() when it reached the server.

        Raises:
            Refused: 503 while shutting down or when ``max_waiting`` requests wait; 429 when ``owner`` has
                ``limit`` requests queued or running (from any front, under any owner).
            InvalidRequest: a value the engine refuses (validation.validate, once the engine has started, with the
                request's model's limits: models.limits_for), an unknown model (field ``model``, naming the models
                offered), the image count (field ``images``), or a job id in use (field ``id``).
            EngineNotReady: the engine failed to start.
        """
        calls = self._calls(request)
        if self.engine.ready.is_set():
            if self.engine.error is not None:
                raise EngineNotReady(f"the engine failed to start: {self.engine.error}")
            limits = models.limits_for(self.engine, request.engine.model)  # an unknown model: refused by name
            request = dataclasses.replace(request, engine=validate(request.engine, limits))
        with self._cond:
            if self.closed:
                raise Refused(503, SHUTTING_DOWN, 60)
            if self.max_waiting is not None and len(self._line) >= self.max_waiting:
                message = (f"the server cannot take this request now: {self.max_waiting} requests wait already "
                           f"(max_queue_size = {self.max_waiting}); retry later")
                LOG.info(f"[app] request refused: {message} (client {owner})")
                raise Refused(503, message, RETRY_AFTER_S)
            client = owner if client is None else client
            if self.held(client) >= self.limit:
                LOG.info(f"[app] request refused: client {client} has {self.limit} requests queued or running "
                         f"(max_requests_per_client = {self.limit})")
                raise Refused(429, over_limit_message(self.limit), RETRY_AFTER_S)
            if job_id is not None and self.store.taken(job_id):
                raise InvalidRequest("id", f"the job id {job_id!r} is in use; send a new one or none")
            job = Job(owner, front, request, calls, job_id, arrived, client)
            self.store.add(job)
            self._line.append(job)
            job.position = len(self._line) - 1
            job.emit("queued", {"position": job.position})
            self._cond.notify_all()
        return job

    def get(self, job_id: str, owner: str | None) -> Job:
        """The job ``job_id`` of ``owner`` (jobs.JobStore.get: raises JobNotFound, JobGone)."""
        return self.store.get(job_id, owner)

    def jobs(self, owner: str | None, front: str | None = None) -> list[Job]:
        """``owner``'s jobs, newest first (only ``front``'s if given)."""
        return self.store.of(owner, front)

    def cancel(self, job_id: str, owner: str | None) -> Job:
        """Stop ``owner``'s job ``job_id``: a queued one leaves the line at once (cancelled, nothing ran); a
        running one stops after its running denoising step; a finished one is left as it is. Returns the job.
        Raises JobNotFound, JobGone."""
        job = self.store.get(job_id, owner)
        self.stop(job)
        return job

    def stop(self, job: Job, reason: str = "cancelled") -> None:
        """:meth:`cancel` for a Job the caller holds (the page's own event); ``reason`` is what its log line says
        ("cancelled"; A1111's "interrupted"; "its client left")."""
        if not job.cancelled.is_set():
            job.stop_reason = reason
        job.cancelled.set()
        with self._cond:
            if job.status != QUEUED or job not in self._line:
                return
            self._line.remove(job)
            job.stopped = "the request was stopped before it started"
            self._finish(job, CANCELLED)
            self._renumber()

    def skip(self, job: Job) -> None:
        """Stop ``job``'s running engine call after its running step; its later calls still run (A1111's skip)."""
        job.skipped.set()

    def held(self, client: str) -> int:
        """``client``'s requests queued or running now (the cap's count)."""
        with self._cond:
            return sum(1 for job in (*self._line, *self._running) if job.client == client)

    @property
    def waiting(self) -> int:
        """Requests queued, not running yet."""
        with self._cond:
            return len(self._line)

    @property
    def running(self) -> int:
        """Requests running now."""
        with self._cond:
            return len(self._running)

    def close(self) -> None:
        """Take no new requests (:meth:`submit` refuses with 503); queued and running ones go on (the drain), then
        the workers end."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def idle(self) -> bool:
        """Whether nothing is queued or running (the shutdown drain waits for it)."""
        with self._cond:
            return not self._line and not self._running

    # ---- the workers ---------------------------------------------------------------------------------------------
    def _calls(self, request: Request) -> int:
        batch = self.engine.batch or 4
        if type(request.images) is not int or not 0 <= request.images <= MAX_CALLS * batch:
            raise InvalidRequest("images", f"this server makes 1 to {MAX_CALLS * batch} images per request "
                                           f"({MAX_CALLS} engine calls of {batch}), got {request.images!r}")
        return max(1, math.ceil((request.images or batch) / batch))

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._line) or self.closed)
                if not self._line:  # closed, and the line drained: this worker is done
                    return
                job = self._line.popleft()
                self._running.add(job)
                job.status, job.position, job.started = RUNNING, None, clock()
                self._renumber()
            try:
                job.emit("started")
                made = self._run(job)
            except BaseException as err:  # noqa: BLE001 - a worker must survive any request
                self._failed(job, err)
                continue
            if isinstance(made, str):  # stopped before any image: nothing to encode
                self._done(job, made)
            else:  # the PNGs are encoded beside the next job's engine calls: the devices do not wait for them
                self._encoder.submit(self._deliver, job, *made)

    def _failed(self, job: Job, err: BaseException) -> None:
        """``job`` failed with ``err``: one log line (a traceback only for an unexpected error)."""
        job.error = err
        if not isinstance(err, EXPECTED):
            LOG.exception(f"[app] request failed: the engine raised {type(err).__name__}: {err}", exc_info=err)
        elif isinstance(err, GenerationError):  # the request could not be made: the operator may want to know
            LOG.error(f"[app] request failed: {err}")
        else:  # the client's to change (or to retry): nothing wrong with the server
            LOG.info(f"[app] request refused: {err}")
        self._done(job, FAILED)

    def _done(self, job: Job, status: str) -> None:
        with self._cond:
            self._running.discard(job)
            self._finish(job, status)

    def _finish(self, job: Job, status: str) -> None:
        """With the lock held: ``job`` ends as ``status``; its followers hear it."""
        job.status, job.position, job.finished = status, None, clock()
        job.emit(status)
        self._cond.notify_all()
        self.store.evict()

    def _renumber(self) -> None:
        """With the lock held: every queued job hears its new place in line."""
        for position, queued in enumerate(self._line):
            if queued.position != position:
                queued.position = position
                queued.emit("queued", {"position": position})

    def _run(self, job: Job):
        """Run ``job``'s engine calls one after another (the seeds following on). Returns its final status when it
        made no image (cancelled), else what :meth:`_deliver` takes: (the calls' results, each with the number of
        its images the client receives, and the message of a stop that cut it short, or None)."""
        engine, request = self.engine, job.request
        while not engine.ready.wait(0.5):
            if job.cancelled.is_set():
                job.stopped = "the request was stopped before it started"
                return CANCELLED
            self._stage(job, "loading")
        if engine.error is not None:
            raise EngineNotReady(f"the engine failed to start: {engine.error}")
        models.start_hashes(engine)
        limits = models.limits_for(engine, request.engine.model)
        first = request.engine if request.engine.validated_for is not None else validate(request.engine, limits)
        batch, wanted = engine.batch, request.images or engine.batch
        made, stopped, seed = [], None, first.seed
        for n in range(job.calls):
            if job.cancelled.is_set():
                break
            call = first if n == 0 else validate(dataclasses.replace(first, seed=seed), limits)
            job.call, job.step, job.steps, job.preview, job.loop_started = n, 0, call.num_inference_steps, None, None
            job.skipped.clear()
            try:
                result = engine.generate(call, progress=lambda stage: self._stage(job, stage),
                                         arrived=job.arrived if n == 0 else None,
                                         on_step=lambda event: self._step(job, event), should_stop=job.stop_requested)
            except Stopped as err:
                why = job.stop_reason if job.cancelled.is_set() else "skipped"
                LOG.info(f"[app] request {err} ({why}); nothing saved")
                stopped = job.stopped = f"the request was {err}"
                if job.cancelled.is_set():
                    break
                seed = (seed + batch) % (engine.limits.max_seed + 1)  # a skip: the next call follows on
                continue
            made.append((result, min(batch, wanted - n * batch)))
            seed = (result.seeds[0] + batch) % (engine.limits.max_seed + 1)
        if not made:  # stopped before any image was made
            if stopped is not None or job.cancelled.is_set():
                return CANCELLED
            raise GenerationError("the request made no images")
        return made, stopped

    def _deliver(self, job: Job, made: list, stopped: str | None) -> None:
        """On the encoder thread: the answer's images (pasted back), their PNGs (encoded once, with A1111's
        parameters), copies in ``outputs_dir``, then ``job`` ends succeeded (or cancelled with the images it has)."""
        request, wanted = job.request, job.request.images or self.engine.batch
        try:
            self._stage(job, "encoding")
            images, pngs, seeds, stems, warnings, info = [], [], [], [], [], None
            for result, keep in made:
                pixels = result.images if request.paste_back is None else request.paste_back.apply(result.images)
                out = delivery.deliver(dataclasses.replace(result, images=pixels), request.prompt, request.style,
                                       None, self.outputs_dir, keep, request.parameters,
                                       models.hash_of(self.engine, result.model))
                if out.save_error is not None:
                    LOG.warning(f"[app] warning: could not save to outputs_dir {self.outputs_dir!r}: {out.save_error}")
                images.append(pixels[:keep])
                pngs += out.pngs[:keep]
                seeds += list(result.seeds[:keep])
                stems += out.stems[:keep]
                warnings += [w for w in out.info["warnings"] if w not in warnings]
                info = info or out.info
            job.result = Result(np.concatenate(images), pngs, seeds, {**info, "seeds": seeds}, warnings, stems,
                                stopped if len(pngs) < wanted else None)
        except BaseException as err:  # noqa: BLE001 - the encoder must survive any request
            self._failed(job, err)
            return
        self._done(job, CANCELLED if job.cancelled.is_set() and len(pngs) < wanted else SUCCEEDED)

    @staticmethod
    def _stage(job: Job, stage: str) -> None:
        if stage == "on device" and job.loop_started is None:
            job.loop_started = clock()
        job.stage = stage
        job.emit("stage", {"stage": stage})

    @staticmethod
    def _step(job: Job, event: StepEvent) -> None:
        """On XLA's callback thread while the devices wait: record and hand on, never block.

        The engine reports steps in batches on fast devices (an event for step k: every step up to k finished), so
        each step since the call's last report gets its own ``step`` event; the call's first report (image to
        image starts past step 1) is its first step. A preview comes with the report's last step."""
        first = job.step + 1 if 0 < job.step < event.step else event.step
        job.step, job.steps = event.step, event.steps
        for step in range(first, event.step + 1):
            job.emit("step", {"step": step, "steps": event.steps, "call": job.call, "calls": job.calls})
        if event.preview is not None:
            job.preview = event.preview
            job.emit("preview", {"step": event.step, "steps": event.steps})

