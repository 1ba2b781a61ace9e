"""The protocols' typed refusal, in a module of its own: image decoding (uploads.py), the page's image input and
every route raise it, and each protocol answers it in its own error shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse


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


# OpenAI's error ``type`` and ``code`` by status, as its own API names them; every ``/v1`` route (the Images API and
# the jobs API) answers in this one shape. Another 4xx is an invalid_request_error, another 5xx a server_error.
OPENAI_ERROR_TYPES = {401: ("invalid_request_error", "invalid_api_key"), 403: ("invalid_request_error", "api_off"),
                      409: ("invalid_request_error", "interrupted"), 429: ("requests", "rate_limit_exceeded"),
                      503: ("server_error", "service_unavailable")}


def openai_error(err: ApiError) -> JSONResponse:
    """``err`` in OpenAI's error shape and status (``{"error": {"message", "type", "param", "code"}}``, ``type`` and
    ``code`` as OpenAI's own errors name them; ``model_not_found`` for a 404 on the model)."""
    kind, code = OPENAI_ERROR_TYPES.get(err.status, ("invalid_request_error" if err.status < 500 else "server_error",
                                                     None))
    if err.status == 404 and err.param == "model":
        code = "model_not_found"
    return JSONResponse({"error": {"message": err.message, "type": kind, "param": err.param, "code": code}},
                        status_code=err.status, headers=err.headers)
