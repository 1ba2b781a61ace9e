"""Who a client is, and the refusal over the per-client cap, for the protocols' request service.

The page's events, gradio_client and MCP submit to the service (sdxl_engine.service), which holds the per-client
cap and the shutdown refusal for them; the protocol APIs (service.RequestService, until they submit there too) use
:func:`over_limit` here, counting the client's jobs in the service with their own. A client is an address
(:func:`client_address`: the peer, or the client a trusted proxy names), never what the client sends: a Gradio
``session_hash`` is the client's own choice, so keying on it let one client take the whole queue with made-up
ones.
"""

from __future__ import annotations

import ipaddress
import logging

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
    the protocols' check of the cap (service.RequestService)."""
    if held < limit:
        return None
    message = over_limit_message(limit)
    log(f"[app] request refused: {message} (client {client})")
    return message


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
