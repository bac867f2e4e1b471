"""The one error a request ends with at the router: a gRPC status, with the request field at fault and
when a retry may succeed. Every API (router/grpc_api.py, router/openai/, router/anthropic/) turns it into
its own error shape in one place."""

from __future__ import annotations

import grpc

# The internal ErrorCode's values are gRPC's own (see scheduler.proto).
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


class RequestFailed(Exception):
    """The status a request ends with. field: the request field at fault (INVALID_ARGUMENT)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str | None = None,
        retry_after_s: float | None = None,  # when a retry may succeed (a refusal for a latency objective)
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
