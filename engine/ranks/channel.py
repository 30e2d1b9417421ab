"""The driver -> ranks channel of one worker: each step the driver broadcasts one message (its plan) to the ranks
1..N-1 and gathers one reply from each. `PlanChannel` is the contract; `ShmPlanChannel` (shared memory, ranks on
the driver's node) and `DistPlanChannel` (a gloo group, ranks anywhere) implement it. Messages are bytes; `encode`
and `decode` turn plain dicts, lists, numbers, strings and bytes into them with msgpack (never pickle).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import msgpack

from pdserve.model.errors import PdserveError

__all__ = [
    "PlanChannel",
    "PlanChannelError",
    "PlanTooLargeError",
    "RankLostError",
    "decode",
    "encode",
]


class PlanChannelError(PdserveError):
    """The channel cannot deliver: a peer is gone or silent past its timeout, or the channel is closed."""


class RankLostError(PlanChannelError):
    """A rank died or did not answer within the timeout; the worker's step failed and the group is unusable."""

    def __init__(self, ranks: list[int], why: str):
        self.ranks = ranks
        super().__init__(f"ranks {ranks} lost: {why}")


class PlanTooLargeError(PlanChannelError, ValueError):
    """A message does not fit the channel's slot (the slot's capacity is fixed when the channel is made)."""


def encode(payload: Any) -> bytes:
    """msgpack of a plain value (dict, list, int, float, str, bytes, bool, None); raises TypeError otherwise."""
    return msgpack.packb(payload, use_bin_type=True)


def decode(message: bytes) -> Any:
    """The value `encode` made; integer dict keys survive."""
    return msgpack.unpackb(message, raw=False, strict_map_key=False)


class PlanChannel(abc.ABC):
    """One worker's channel between its driver (rank 0) and its ranks 1..N-1, used in lock step:

        driver: broadcast(m_k); gather() -> [r_1, ..., r_{N-1}]; broadcast(m_{k+1}); ...
        rank i: receive() -> m_k; reply(r_i); receive() -> m_{k+1}; ...

    A rank replies exactly once to each message before receiving the next, and the driver gathers every reply to
    a message before broadcasting the next one; the channel may rely on this and reuse its buffers. Messages are
    delivered whole and in order. Every wait is bounded: `gather` raises `RankLostError` naming the ranks that
    did not answer within `timeout_s` (or that `check` found dead), and never hangs. A message larger than the
    channel accepts raises `PlanTooLargeError` at the sender, before anything is sent. After any error the
    channel is unusable: the worker fails its step and tears its ranks down.
    """

    world_size: int
    """Ranks of the worker, the driver included."""
    rank: int
    """This side's rank: 0 for the driver."""

    @abc.abstractmethod
    def broadcast(self, message: bytes) -> None:
        """Driver: send `message` to every rank 1..N-1."""

    @abc.abstractmethod
    def gather(self, timeout_s: float, check: Callable[[], None] | None = None) -> list[bytes]:
        """Driver: the replies of ranks 1..N-1 to the last broadcast, in rank order. `check`, if given, is called
        now and then while waiting and may raise (e.g. `RankLostError` for a rank whose process exited)."""

    @abc.abstractmethod
    def receive(self, timeout_s: float | None) -> bytes | None:
        """Rank: the next message, or None when none came within `timeout_s` (None: wait as long as the
        implementation allows). An implementation that cannot resume a timed-out wait raises
        `PlanChannelError` instead of returning None; its docstring says so."""

    @abc.abstractmethod
    def reply(self, message: bytes) -> None:
        """Rank: answer the last message received."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this side's resources; idempotent."""
