"""The engine's request error, in a module of its own so that validation.py and prompts.py (which
validation uses) both raise it without importing each other."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request argument the engine cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled as its two arguments (Ray carries it from a replica to the front)
        return type(self), (self.field, self.message)
