"""The serving layer's errors: what the router, admission, scaling and the rank actors raise. Which status a
client sees for each is the front ends' business (`pdserve.frontend.errors`)."""

from __future__ import annotations

from pdserve.engine.messages import RANK_GROUP_FAILED
from pdserve.model.errors import (
    PdserveError,
    RequestAbortedError,
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
