"""The one mapping from exceptions to gRPC status codes (`status_for`) and the one from exceptions to HTTP
statuses (`http_error_for`, derived from the gRPC code, so both front ends classify an error alike). Front ends
catch `PdserveError` and answer with these; anything else is a bug, logged with its traceback at the front end's
boundary and returned as INTERNAL (HTTP 500)."""

from __future__ import annotations

import dataclasses

import grpc

from pdserve.cluster.errors import (
    DeadlineExceededError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnavailableError,
    WorkerFailedError,
    WorkerLostError,
)
from pdserve.engine.messages import WorkerError
from pdserve.model.errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    RequestAbortedError,
    TransferError,
)

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


class BodyTooLargeError(InvalidRequestError):
    """An HTTP request body past the server's limit: 413, answered before the rest of it is read."""


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
    if isinstance(error, BodyTooLargeError):
        status = 413
    param = error.field if isinstance(error, InvalidRequestError) else None
    return HttpError(status, kind, message, param, code.name.lower())
