"""Errors of the serving layer, the one mapping from exceptions to gRPC status codes (`status_for`) and the one
from exceptions to HTTP statuses (`http_error_for`, derived from the gRPC code, so both front ends classify an
error alike). Front ends catch `PdserveError` and answer with these; anything else is a bug, logged with its
traceback at the front end's boundary and returned as INTERNAL (HTTP 500)."""

from __future__ import annotations

import dataclasses

import grpc

from pdserve.engine.messages import RANK_GROUP_FAILED, WorkerError
from pdserve.model.errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    PdserveError,
    RequestAbortedError,
    TransferError,
)


class DeadlineExceededError(RequestAbortedError):
    """The client's deadline passed before the request finished."""


class UnavailableError(PdserveError):
    """The server cannot take the request now (starting, shutting down, no decode worker serving)."""


class WorkerLostError(PdserveError):
    """A worker holding the request died or was stopped; the message names it and why."""


class WorkerFailedError(PdserveError):
    """A worker failed the request: a KV transfer or a forward pass went wrong (the message says which)."""

    def __init__(self, message: str):
        super().__init__(message)
        # Forward passes that raised are bugs or bad hardware (INTERNAL); transfers, timeouts and a worker's lost
        # rank (its pass fails with the rank group) are retryable.
        self.internal = (
            "prefill failed:" in message or "decode failed:" in message
        ) and RANK_GROUP_FAILED not in message


class NotFoundError(PdserveError):
    """No such worker (admin calls)."""


class UnauthenticatedError(PdserveError):
    """No key, or a key that is not this server's."""


class PermissionDeniedError(PdserveError):
    """A valid key that may not make this call (the API key on an admin call)."""


class PreconditionError(PdserveError):
    """The admin call would leave the server unable to serve (e.g. draining the last decode worker)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (WorkerLostError, grpc.StatusCode.UNAVAILABLE),
    (TransferError, grpc.StatusCode.UNAVAILABLE),
    (RequestAbortedError, grpc.StatusCode.UNAVAILABLE),
    (WorkerError, grpc.StatusCode.INTERNAL),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `error`."""
    if isinstance(error, WorkerFailedError):
        code = grpc.StatusCode.INTERNAL if error.internal else grpc.StatusCode.UNAVAILABLE
        return code, str(error)
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    # code: (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class HttpError:
    """An error as the OpenAI-compatible API answers it: `{"error": {message, type, param, code}}`."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def http_error_for(error: BaseException) -> HttpError:
    """The HTTP status and OpenAI-shaped error a client sees for `error`; `param` names the request field of an
    InvalidRequestError."""
    code, message = status_for(error)
    status, kind = _HTTP.get(code, (500, "server_error"))
    param = error.field if isinstance(error, InvalidRequestError) else None
    return HttpError(status, kind, message, param, code.name.lower())
