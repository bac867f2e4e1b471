"""The one error a request check raises (router/validation.py, sampling_checks.py, chat.py): the field at
fault, by its proto path (e.g. "sampling.top_p", "messages[2].role"), and a message naming the limit, so
each API answers INVALID_ARGUMENT with something a client can act on."""

from __future__ import annotations


class ValidationError(ValueError):
    """A request the server will not run; maps to gRPC INVALID_ARGUMENT (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return self.message
