"""Who a client is for the per-client cap (serving/admission.py): an address, never a session hash (the cap itself:
tests/serving/test_handler_follow.py, tests/service/test_service_jobs.py)."""

import asyncio

import pytest
from starlette.requests import Request

from sdxl_engine.config import ConfigError, EngineConfig, trusted_networks
from sdxl_engine.serving import admission
from sdxl_engine.serving.admission import client_address
from sdxl_engine.serving.server import forwarded_allow_ips


def request(peer: str, forwarded: str | None = None) -> Request:
    headers = [] if forwarded is None else [(b"x-forwarded-for", forwarded.encode())]
    return Request({"type": "http", "client": (peer, 40000), "headers": headers})


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
