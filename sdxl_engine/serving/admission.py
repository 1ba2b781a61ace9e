"""Who a client is: an address (:func:`client_address`: the peer, or the client a trusted proxy names), never what
the client sends: a Gradio ``session_hash`` is the client's own choice, so keying on it let one client take the whole
queue with made-up ones. The service (sdxl_engine.service) counts its per-client cap, for every front, by it.
"""

from __future__ import annotations

import ipaddress
import logging

LOG = logging.getLogger(__name__)

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
