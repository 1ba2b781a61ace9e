"""The per-client cap (serving/admission.py): who a client is, and that a third call from one is refused."""

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from sdxl_engine.config import ConfigError, EngineConfig, trusted_networks
from sdxl_engine.serving import admission, gradio_internals
from sdxl_engine.serving.admission import Admission, client_address, over_limit_message
from sdxl_engine.serving.server import forwarded_allow_ips


def request(peer: str, forwarded: str | None = None) -> Request:
    headers = [] if forwarded is None else [(b"x-forwarded-for", forwarded.encode())]
    return Request({"type": "http", "client": (peer, 40000), "headers": headers})


class FakeQueue:
    """What Admission reads of Gradio's queue: its live events, and push (which queues every call)."""

    def __init__(self):
        self.event_ids_to_events: dict = {}
        self.pushed: list[str] = []

    async def push(self, body, request, username):
        event_id = f"event-{len(self.pushed)}"
        self.pushed.append(body.session_hash)
        self.event_ids_to_events[event_id] = body
        return True, event_id, "success"


def body(session_hash: str | None) -> SimpleNamespace:
    return SimpleNamespace(fn_index=7, session_hash=session_hash)


@pytest.fixture
def refusals(monkeypatch):
    """The messages of the calls refused through the page's protocol (an event that fails at once)."""
    seen = []

    async def fail_at_once(queue, body, request, username, message):
        seen.append((body.session_hash, message))
        return "refused-event"

    monkeypatch.setattr(gradio_internals, "fail_at_once", fail_at_once)
    return seen


def test_one_address_is_one_client_whatever_session_hashes_it_sends(refusals):
    queue = FakeQueue()
    gate = Admission(queue, fn_ids=[7], limit=2, closing=lambda: False, log=lambda line: None)
    results = [asyncio.run(gate.push(body(f"made-up-{i}"), request("203.0.113.9"), None)) for i in range(3)]
    assert [r[1] for r in results] == ["event-0", "event-1", "refused-event"]
    assert queue.pushed == ["made-up-0", "made-up-1"]  # the third never took a place
    assert refusals == [("made-up-2", over_limit_message(2))]
    assert gate.held("203.0.113.9") == 2
    # Another address has its own places, and a raw call (no session) from the first is refused by status.
    assert asyncio.run(gate.push(body("made-up-3"), request("203.0.113.10"), None))[1] == "event-2"
    with pytest.raises(HTTPException) as raw:
        asyncio.run(gate.push(body(None), request("203.0.113.9"), None))
    assert (raw.value.status_code, raw.value.detail) == (429, over_limit_message(2))
    del queue.event_ids_to_events["event-0"]  # Gradio finished one: its place is free again
    assert asyncio.run(gate.push(body("made-up-4"), request("203.0.113.9"), None))[1] == "event-3"


def _client_behind(allow: str, peer: str, forwarded: str | None) -> str:
    """The cap's client for a request from ``peer`` as the served app sees it: through uvicorn's proxy-headers
    layer (Gradio's server has it on) trusting ``allow``, then client_address."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    seen = []

    async def app(scope, receive, send):
        seen.append(client_address(Request(scope)))

    scope = request(peer, forwarded).scope
    asyncio.run(ProxyHeadersMiddleware(app, trusted_hosts=allow)({**scope, "scheme": "http"}, None, None))
    return seen[0]


def test_forwarded_address_counts_only_behind_a_trusted_proxy():
    assert forwarded_allow_ips("") == ""
    assert forwarded_allow_ips(" 10.0.0.2, 192.168.0.0/16") == "10.0.0.2,192.168.0.0/16"
    assert forwarded_allow_ips("10.0.0.2", share=True) == "10.0.0.2,127.0.0.1,::1"  # the share tunnel's end
    proxy = forwarded_allow_ips("10.0.0.2, 192.168.0.0/16")
    # No trusted proxy: X-Forwarded-For is the client's own text, ignored (uvicorn's default would trust loopback).
    assert _client_behind(forwarded_allow_ips(""), "127.0.0.1", "198.51.100.7") == "127.0.0.1"
    assert _client_behind(proxy, "203.0.113.9", "198.51.100.7") == "203.0.113.9"  # the peer is not a proxy
    assert _client_behind(proxy, "10.0.0.2", "198.51.100.7") == "198.51.100.7"
    # What the client wrote itself is left of what the proxies appended, never reached.
    assert _client_behind(proxy, "10.0.0.2", "1.2.3.4, 198.51.100.7, 192.168.4.4") == "198.51.100.7"
    assert _client_behind(proxy, "10.0.0.2", None) == "10.0.0.2"  # no header: the proxy itself


def test_an_ipv6_client_counts_by_its_64_block():
    assert client_address(request("2001:db8:1:2::5")) == client_address(request("2001:db8:1:2:ffff::9")) \
        == "2001:db8:1:2::/64"
    assert client_address(request("2001:db8:1:3::5")) == "2001:db8:1:3::/64"
    assert client_address(request("::ffff:203.0.113.9")) == "203.0.113.9"
    assert client_address(Request({"type": "http", "headers": []})) == "unknown"


def test_trusted_proxies_is_a_checked_setting():
    assert EngineConfig().trusted_proxies == ""
    config = EngineConfig.load(environ={"SDXL_TRUSTED_PROXIES": "127.0.0.1,10.0.0.0/8"})
    assert [str(n) for n in trusted_networks(config.trusted_proxies)] == ["127.0.0.1/32", "10.0.0.0/8"]
    with pytest.raises(ConfigError, match=r"^trusted_proxies: 'proxy.local' is not an IP address or network"):
        EngineConfig.load({"trusted_proxies": "10.0.0.1,proxy.local"}, environ={})


def test_the_session_hash_no_longer_names_a_client():
    assert not hasattr(admission, "client_key")
