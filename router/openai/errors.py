"""OpenAI's error answers: {"error": {"message", "type", "param", "code"}}, and the one mapping of a Frontend
failure (a gRPC status, router/request_failed.py) to one, its field renamed to the name the client used."""

from __future__ import annotations

import re

import grpc

from router.frontend import RequestFailed

# The gRPC status a failure has on the gRPC API -> the HTTP status it has here.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An error answer: HTTP `status` and OpenAI's body. code is the gRPC status name the same failure has
    on the gRPC API (INVALID_ARGUMENT, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,  # the Retry-After header (a 429 for a latency objective)
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param, code=grpc.StatusCode.INVALID_ARGUMENT.name)


def from_failure(e: RequestFailed, params: dict[str, str]) -> ApiError:
    """params: GenerateRequest field -> the name the client's request used for it; the field and its
    mentions in the message are renamed (sampling.temperature -> temperature, token_ids[3] -> prompt[3])."""
    param, message = None, e.message
    renames = {k: v for k, v in params.items() if "_" in k or "." in k}  # identifiers, not plain words
    if e.field:
        base = re.match(r"[A-Za-z_.]*", e.field).group()
        param = params.get(base, base) + e.field[len(base) :]
        renames[base] = params.get(base, base)
    for old, new in renames.items():
        if old != new:
            message = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, message)
    return ApiError(
        HTTP_STATUS.get(e.code, 500), message, param=param, code=e.code.name, retry_after_s=e.retry_after_s
    )
