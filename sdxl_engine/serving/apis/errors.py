"""The protocols' typed refusal, in a module of its own: image decoding (uploads.py), the page's image input and
every route raise it, and each protocol answers it in its own error shape."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal or failure to answer in the protocol's own error shape.

    ``status``: the HTTP status (400 bad value, 401 no or wrong key, 404, 429 over the per-client
    limit, 500 the engine failed, 503 not started / shutting down / queue full); ``message``: one
    line for the user (the engine's own for a bad value); ``param``: the request field at fault,
    if one is; ``headers``: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
