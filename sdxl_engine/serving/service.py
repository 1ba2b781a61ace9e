"""The request service: the one place every generation passes, whichever front end it came from.

The page's events, gradio_client and MCP (Gradio's events, whose function is :meth:`RequestService.generate`) and
the protocol APIs (``/sdapi/v1``, ``/v1``: :meth:`RequestService.run`, called in memory, not through Gradio's
queue) all take one of the service's :class:`Slots` before the engine runs, in order of arrival, so the engine is
called by at most ``slots`` requests at once (one per Ray Serve replica with ``--replicas``; one plus the
compiles that may run beside it locally). The service also owns the protocols' admission (the per-client cap,
counted together with the client's Gradio events: admission.Admission) and counts every running request for the
shutdown drain (guard.RequestGate). Progress, interrupt and skip are per request id (progress.JOBS).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import html
import logging
import threading
from collections.abc import Awaitable, Callable

from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.errors import CompilesBusy
from sdxl_engine.engine.steps import Stopped
from sdxl_engine.engine.validation import InvalidRequest
from sdxl_engine.service.styles import UnknownStyle
from sdxl_engine.serving.admission import RETRY_AFTER_S, SHUTTING_DOWN, over_limit
from sdxl_engine.serving.progress import JOBS

LOG = logging.getLogger(__name__)
LEFT_POLL_S = 0.5  # how often a running protocol call asks whether its client is still there (RequestService.run)


class Slots:
    """``n`` places in front of the engine, given in order of arrival (FIFO), usable from any thread.

    A caller that finds none free waits; ``should_stop()`` (asked every ``poll_s`` while it waits) lets it leave
    its place in line, with nothing run. Raises ValueError for ``n`` < 1.
    """

    def __init__(self, n: int, poll_s: float = 0.1):
        if n < 1:
            raise ValueError(f"a request service needs at least one slot, got {n}")
        self.n = n
        self.poll_s = poll_s
        self._cond = threading.Condition()
        self._taken = 0
        self._line: collections.deque[object] = collections.deque()

    @property
    def taken(self) -> int:
        """Slots in use now."""
        return self._taken

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now."""
        return len(self._line)

    def take(self, should_stop: Callable[[], bool] | None = None, on_wait: Callable[[], None] | None = None) -> None:
        """Take a slot: at once when one is free and no one waits, else after ``on_wait()`` in order of arrival.

        Raises Stopped("stopped before it started") when ``should_stop()`` answered True while it waited."""
        ticket = object()
        if self._enter(ticket):
            return
        if on_wait is not None:
            on_wait()
        try:
            with self._cond:
                while not self._turn(ticket):
                    if should_stop is not None and should_stop():
                        raise Stopped("stopped before it started")
                    self._cond.wait(self.poll_s)
        except BaseException:
            self._leave(ticket)
            raise

    async def take_async(self, should_stop: Callable[[], Awaitable[bool]] | None = None) -> None:
        """:meth:`take` for a coroutine: it waits in the same line without holding a thread, looking every
        ``poll_s``; ``await should_stop()`` answering True leaves the line (Raises Stopped, as :meth:`take`)."""
        ticket = object()
        if self._enter(ticket):
            return
        try:
            while True:
                with self._cond:
                    if self._turn(ticket):
                        return
                if should_stop is not None and await should_stop():
                    raise Stopped("stopped before it started")
                await asyncio.sleep(self.poll_s)
        except BaseException:  # stopped, or the route's task cancelled: out of the line
            self._leave(ticket)
            raise

    def _enter(self, ticket: object) -> bool:
        """Take a slot at once if one is free and no one waits (True), else put ``ticket`` at the end of the line."""
        with self._cond:
            if self._taken < self.n and not self._line:
                self._taken += 1
                return True
            self._line.append(ticket)
            return False

    def _turn(self, ticket: object) -> bool:
        """With the lock held: take a slot for ``ticket`` if it is first in line and one is free."""
        if self._line[0] is not ticket or self._taken >= self.n:
            return False
        self._line.popleft()
        self._taken += 1
        self._cond.notify_all()
        return True

    def _leave(self, ticket: object) -> None:
        """``ticket`` leaves the line (if it is still in it); the next in line may be first now."""
        with self._cond:
            if ticket in self._line:
                self._line.remove(ticket)
                self._cond.notify_all()

    def give(self) -> None:
        """Give a slot back (once per :meth:`take` that returned)."""
        with self._cond:
            self._taken -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, should_stop: Callable[[], bool] | None = None, on_wait: Callable[[], None] | None = None):
        """:meth:`take` on entry, :meth:`give` on exit."""
        self.take(should_stop, on_wait)
        try:
            yield
        finally:
            self.give()


class Refused(Exception):
    """The service did not take a protocol request: ``status`` 429 (the client's cap) or 503 (shutting down),
    ``message`` for the client, ``retry_after_s`` for its ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after_s: int):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class Failed(Exception):
    """A protocol request's engine call failed: ``message`` as the page shows it (text, not HTML), ``cause`` the
    engine's typed error (InvalidRequest, UnknownStyle, CompilesBusy, Stopped, EngineNotReady, GenerationError,
    or another exception: a failure logged with its traceback)."""

    def __init__(self, message: str, cause: BaseException | None):
        super().__init__(message)
        self.message = message
        self.cause = cause

    @property
    def stopped(self) -> bool:
        """Whether the call was stopped (its owner's interrupt or skip, or its client left while it waited)."""
        return isinstance(self.cause, Stopped)

    @property
    def busy(self) -> bool:
        """Whether the engine was compiling as many new sizes as it may (retry later)."""
        return isinstance(self.cause, CompilesBusy)

    @property
    def bad_value(self) -> bool:
        """Whether the engine refused a value of the request."""
        return isinstance(self.cause, (InvalidRequest, UnknownStyle))


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One engine call of a protocol request: the handler's ``info`` record, the PNGs' ``paths`` (in Gradio's
    temp folder, never sent to a client) and their bytes ``pngs`` (from memory)."""

    info: dict
    paths: list[str]
    pngs: list[bytes]


class RequestService:
    """See the module docstring.

    Args:
        engine: the engine contract (local or the Ray front).
        handle: handler.handle_generate (the engine first, then the nine ``/generate`` values; its keywords).
        gate: the shutdown gate: counts what runs, refuses new requests once closed.
        slots: requests the engine is called with at once.
        limit: a client's requests queued or running at once (``max_requests_per_client``).
        max_waiting: requests that may wait at once (``max_queue_size``): a protocol request that finds that many
            waiting (in the slots' line and in Gradio's queue: :attr:`gradio_waiting`) is refused; None = no bound.
        log: one line per refusal.
    """

    def __init__(self, engine: EngineContract, handle: Callable, gate, slots: int, limit: int,
                 max_waiting: int | None = None, log=LOG.info):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.engine = engine
        self.handle = handle
        self.gate = gate
        self.slots = Slots(slots)
        self.limit = limit
        self.max_waiting = max_waiting
        self.log = log
        self.gradio_held: Callable[[str], int] = lambda client: 0  # the client's Gradio events (Admission.held)
        self.gradio_waiting: Callable[[], int] = lambda: 0  # calls waiting in Gradio's queue (gradio_internals.waiting)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # client -> its protocol requests admitted and not finished
        # One worker thread per slot, for the protocols' calls: asyncio's default pool (cpu count + 4 threads) would
        # cap them below the slots on a small host in front of many replicas, and the routes' decoding shares it.
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="protocol-request")

    # ---- Gradio's events (the page, gradio_client, MCP) ---------------------------------------------------------
    def generate(self, *values, **kwargs):
        """The Gradio events' function: ``handle(engine, *values, **kwargs)`` in a slot, counted by the gate."""
        return self.gate.run(self.handle, self.engine, *values, slots=self.slots, **kwargs)

    # ---- the protocols --------------------------------------------------------------------------------------------
    def held(self, client: str) -> int:
        """The protocol requests of ``client`` admitted and not finished."""
        with self._lock:
            return self._held.get(client, 0)

    @contextlib.contextmanager
    def admitted(self, client: str):
        """Hold a place for one protocol request of ``client`` (all its engine calls) while the block runs.

        Raises Refused: 503 while the server shuts down, or when ``max_waiting`` requests wait already; 429 when
        the client already has ``limit`` requests queued or running, counting its Gradio events
        (:attr:`gradio_held`) with its protocol requests."""
        with self._lock:
            if self.gate.closed:
                raise Refused(503, SHUTTING_DOWN, 60)
            if self.max_waiting is not None and self.slots.waiting + self.gradio_waiting() >= self.max_waiting:
                message = (f"the server cannot take this request now: {self.max_waiting} requests wait already "
                           f"(max_queue_size = {self.max_waiting}); retry later")
                self.log(f"[app] request refused: {message} (client {client})")
                raise Refused(503, message, RETRY_AFTER_S)
            if (message := over_limit(self._held.get(client, 0) + self.gradio_held(client), self.limit, client,
                                      self.log)) is not None:
                raise Refused(429, message, RETRY_AFTER_S)
            self._held[client] = self._held.get(client, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[client] -= 1
                if not self._held[client]:
                    del self._held[client]

    async def run(self, values: tuple, *, job: str, client: str, keep: int | None = None, extra=None, request=None,
                  arrived: float | None = None, left: Callable[[], Awaitable[bool]] | None = None) -> CallResult:
        """One engine call of a protocol request (admitted with :meth:`admitted`): it waits for a slot in line with
        every other call (without a thread, counted by the gate), then runs the handler on a worker thread.

        ``values``: the nine ``/generate`` values (handler.GENERATE_INPUTS); ``job``: the request's progress.JOBS
        id; ``keep``: how many of the images the client receives, if fewer than the batch (only they are saved);
        ``extra``: handler.ProtocolInputs; ``request``: the engine's request for ``values`` when the caller built
        and validated it (apis.core.check), else None (the handler builds it); ``arrived``: contract.clock() at the
        server. ``left``: an async callable answering whether the client has gone (Starlette's
        ``is_disconnected``): a call whose client has left, or whose job was interrupted, before its turn (asked
        first, then while it waits for its slot) does not run (one line logged); a call whose client leaves while it
        runs stops after the running step (asked every :data:`LEFT_POLL_S`; its job is cancelled, one line logged),
        so that the next caller does not wait for images no one will read.

        Raises Failed with the engine's typed error and the page's message (HTML entities undone).
        """

        async def stop_waiting() -> bool:
            # an interrupt, not a skip: a skip is of the running call, and the next call's begin clears it
            return JOBS.interrupted(job) or (left is not None and await left())

        kwargs = dict(job=job, client=client, keep=keep, arrived=arrived, extra=extra, request=request)
        with self.gate.counted():
            try:
                if await stop_waiting():  # gone already: a free slot would let it run for no one
                    raise Stopped("stopped before it started")
                await self.slots.take_async(stop_waiting)
            except Stopped as err:
                why = "interrupted" if JOBS.interrupted(job) else "its client left"
                self.log(f"[app] request {err} ({why}); nothing saved")
                raise Failed(f"the request was {err}", err) from None
            watch = None if left is None else asyncio.ensure_future(self._cancel_when_left(job, left))
            try:
                info, paths, pngs = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self._call, values, kwargs)
            finally:
                if watch is not None:
                    watch.cancel()
                self.slots.give()
        return CallResult(info, paths, pngs)

    async def _cancel_when_left(self, job: str, left: Callable[[], Awaitable[bool]]) -> None:
        """Cancel ``job`` once ``left()`` says its client has gone (run's running call; cancelled when it ends)."""
        while not await left():
            await asyncio.sleep(LEFT_POLL_S)
        self.log("[app] a protocol request's client left while it ran: stopping it after the running step")
        JOBS.cancel(job)

    def _call(self, values: tuple, kwargs: dict) -> tuple[dict, list[str], list[bytes]]:
        job = kwargs["job"]
        try:
            gallery, info, _record = self.handle(self.engine, *values, **kwargs)  # in the slot run() holds
        except Exception as err:  # the handler raises the page's error (gr.Error) from the engine's typed one
            message = getattr(err, "message", None) or str(err) or "the engine failed on this request"
            raise Failed(html.unescape(str(message)), err.__cause__) from err
        paths = [item[0] for item in gallery]
        pngs = JOBS.take_pngs(job)
        if len(pngs) != len(paths):  # the handler delivers every call's PNGs to its job (handler.handle_generate)
            raise Failed("the engine's images did not reach this request; please retry", None)
        return info, paths, pngs
