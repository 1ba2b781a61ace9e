"""Who may start a /generate call now: refusals at arrival, in Gradio's queue (one per new call).

Every queued call, whichever way it came (the page and gradio_client: ``POST /queue/join``; raw
HTTP: ``POST /call/generate``), enters Gradio through ``Queue.push``. :class:`Admission` wraps
that method for the counted endpoints (``/generate``) and refuses a call before it takes a place:

- while the server shuts down (:class:`~.guard.RequestGate` closed): ``the server is shutting
  down; retry in a minute``;
- when its client already has ``limit`` calls queued or running (``max_requests_per_client``), its
  protocol requests in the request service counted too (service.RequestService.held): a message
  naming the limit. A client
  is an address (:func:`client_address`: the peer, or the client a trusted proxy names), never what the
  client sends: a Gradio ``session_hash`` is the client's own choice, so keying on it let one client
  take the whole queue with made-up ones.

A refused call never waits and delays no other call (no lock is taken, nothing is queued).

How each client sees the refusal: a ``/queue/join`` is answered 200 with an event id whose one
message is a failed completion carrying the text, as for a ``gr.Error`` raised by the handler, so
the page shows its error pop-up and gradio_client raises ``AppError`` with the text (an HTTP
error status would not do: for a 503 both show their own "queue is full"/"busy" line, and
gradio_client drops the body of any other status). A raw ``/call/`` gets an HTTP status with the
text in ``detail``: 429 over the limit (``Retry-After``); during a shutdown :class:`~.guard.Guard`
answers raw calls itself (503).

A call whose client has gone before it runs is dropped by Gradio itself: when a session's result
stream (``queue/data``, or a raw call's ``call/<api>/<event id>``) closes, Gradio's queue removes
that session's waiting events and marks its running ones as gone (``Queue.clean_events``).

The count cannot leak: it is not kept by hand but read from Gradio's own table of live events
(gradio_internals.live_event_ids: an event is there from the moment it is queued until it has run,
failed, been cancelled or lost its client), plus the pushes still under way. Every use of Gradio's
internals here goes through :mod:`.gradio_internals`.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import HTTPException

from sdxl_engine.serving import gradio_internals

if TYPE_CHECKING:
    from sdxl_engine.serving.gradio_internals import PredictBody, Queue

LOG = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # for a client over its limit: about one generation
# Every client's refusal during a stop (the guard's too).
SHUTTING_DOWN = "the server is shutting down; retry in a minute"


def over_limit_message(limit: int) -> str:
    """The refusal for a client that already has ``limit`` calls queued or running."""
    calls = "call" if limit == 1 else "calls"
    return (f"this client already has {limit} {calls} queued or running, the most allowed per client "
            f"(max_requests_per_client = {limit}); retry when one has finished")


def over_limit(held: int, limit: int, client: str, log=LOG.info) -> str | None:
    """The refusal when ``client`` already holds ``held`` >= ``limit`` calls (after one log line), else None:
    the one check of the cap, for Gradio's calls (:class:`Admission`) and the protocols' (service.RequestService)."""
    if held < limit:
        return None
    message = over_limit_message(limit)
    log(f"[app] request refused: {message} (client {client})")
    return message


class Admission:
    """Wraps ``queue.push``: refuses new calls of ``fn_ids`` while ``closing()`` or over ``limit`` per client.

    Args:
        queue: the demo's Gradio queue (gradio_internals.queue_of, after ``demo.queue(...)``).
        fn_ids: ids of the counted events (their ``fn_index``); other events pass untouched.
        push: the queue's own ``push``, which this one calls for the calls it lets through
            (default: ``queue.push`` as it is now).
        limit: calls one client may have queued or running at once, at least 1.
        closing: whether the server is shutting down (``RequestGate.closed``).
        log: one line per refusal over the limit.
        also_held: the client's requests held elsewhere that count against its limit (the request
            service's protocol requests: service.RequestService.held).
    """

    def __init__(self, queue: Queue, fn_ids, limit: int, closing: Callable[[], bool], log=LOG.info,
                 push: Callable | None = None, also_held: Callable[[str], int] | None = None):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.queue = queue
        self.fn_ids = frozenset(fn_ids)
        self.limit = limit
        self.closing = closing
        self.log = log
        self._push = push or queue.push
        self.also_held = also_held or (lambda client: 0)
        self._events: dict[str, set[str]] = {}  # client -> ids of its events Gradio may still hold
        self._arriving: dict[str, int] = {}  # client -> pushes under way (not yet in Gradio's table)

    @classmethod
    def install(cls, demo, limit: int, closing: Callable[[], bool], api_names=("generate",),
                log=LOG.info, also_held: Callable[[str], int] | None = None) -> Admission:
        """Wrap the demo's queue's ``push`` for the events named ``api_names``; returns the admission.

        Call after ``demo.queue(...)`` (it replaces the queue) and before serving. Off the queue,
        POST /run/<api> (Gradio's api_open, on outside Spaces) would run a call uncounted, so
        gradio_internals.wrap_push closes that route too: queued events are reached through the queue only.
        """
        queue = gradio_internals.queue_of(demo)
        admission = cls(queue, gradio_internals.fn_indices(demo, api_names), limit, closing, log,
                        push=queue.push, also_held=also_held)
        gradio_internals.wrap_push(demo, admission.push)
        return admission

    def held(self, client: str) -> int:
        """Calls of ``client`` queued, running or arriving now."""
        live = gradio_internals.live_event_ids(self.queue)
        ids = self._events.get(client)
        if ids is not None:
            ids.intersection_update(live)
            if not ids:
                del self._events[client]
        return len(self._events.get(client, ())) + self._arriving.get(client, 0)

    def total(self) -> int:
        """Calls queued, running or arriving now, over all clients."""
        return sum(self.held(client) for client in list(self._events) + list(self._arriving))

    async def push(self, body: PredictBody, request, username: str | None):
        """``Queue.push`` with the refusals above; same arguments and result."""
        if body.fn_index not in self.fn_ids:
            return await self._push(body=body, request=request, username=username)
        client = client_address(request)
        self.total()  # forget the events Gradio has finished with, for every client
        if self.closing():
            return await self._refuse(body, request, username, SHUTTING_DOWN, 503)
        message = over_limit(self.held(client) + self.also_held(client), self.limit, client, self.log)
        if message is not None:
            return await self._refuse(body, request, username, message, 429)
        self._arriving[client] = self._arriving.get(client, 0) + 1  # before the first await: no race
        try:
            success, event_id, state = await self._push(body=body, request=request, username=username)
        finally:
            self._arriving[client] -= 1
            if not self._arriving[client]:
                del self._arriving[client]
        if success:
            self._events.setdefault(client, set()).add(event_id)
        return success, event_id, state

    async def _refuse(self, body: PredictBody, request, username: str | None, message: str,
                      status: int):
        """Refuse one call: an HTTP error for a raw /call/, else an event that fails at once with ``message``."""
        if body.session_hash is None:  # a raw /call/: its own client reads the HTTP status
            headers = {"Retry-After": str(60 if status == 503 else RETRY_AFTER_S)}
            raise HTTPException(status_code=status, detail=message, headers=headers)
        return True, await gradio_internals.fail_at_once(self.queue, body, request, username, message), "success"


def client_address(request) -> str:
    """Who sent ``request`` (a Starlette request), for the per-client cap: an address the client cannot choose.

    The peer's address as the server sees it: uvicorn's proxy-headers layer has already put the
    ``X-Forwarded-For`` client there when the peer is a trusted proxy (``FORWARDED_ALLOW_IPS``, which
    server.serve sets from the ``trusted_proxies`` setting), and from anyone else the header is ignored.
    An IPv6 client counts by its /64 network, the block one host is usually given, so it cannot take new
    places by changing the low bits. "unknown" if there is no peer.
    """
    return _client_of(getattr(getattr(request, "client", None), "host", None) or "unknown")


def _client_of(address: str) -> str:
    """The cap's key for ``address``: itself (IPv4), its /64 (IPv6), the text as it is if not an address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)
