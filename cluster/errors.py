"""Errors of the serving layer and the one mapping from exceptions to gRPC status codes. Servicers catch
`PdserveError` and abort the call with `status_for`; anything else is a bug, logged with its traceback at the
servicer boundary and returned as INTERNAL."""

from __future__ import annotations

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


class PreconditionError(PdserveError):
    """The admin call would leave the server unable to serve (e.g. draining the last decode worker)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
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
