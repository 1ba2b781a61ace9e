"""The engine's errors, as types: each crosses the request handler, the protocols and Ray as itself (never as a
class name or a message to match). In a module of their own so that validation.py and prompts.py both raise
InvalidRequest without importing each other, and the serving layer names them without loading the engine."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request argument the engine cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled as its two arguments (Ray carries it from a replica to the front)
        return type(self), (self.field, self.message)


class EngineNotReady(RuntimeError):
    """The engine failed to start (the message says why) or did not become ready in time."""


class GenerationError(RuntimeError):
    """The program ran but produced something unusable (non-finite pixels)."""


class CompilesBusy(RuntimeError):
    """A request needs a program that is not compiled yet, and its client already waits for another
    new size, or ``max_pending_compiles`` sizes compile already: retry once those are ready (the
    message says which sizes compile). Nothing ran."""


class ModelUnavailable(RuntimeError):
    """A request's model (GenerateRequest.model, a name the server offers) could not be loaded: its files went
    missing or broken since the start, or it does not fit this server (the message says which and why). Nothing
    ran; the other models serve on."""
