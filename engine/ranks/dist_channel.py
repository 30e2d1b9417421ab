"""`PlanChannel` over a torch.distributed gloo group, for ranks on other nodes than the driver (a GB200 NVL72
worker spans the nodes of one NVLink domain, where shared memory cannot reach).

A broadcast is one gloo broadcast from the group's rank 0 of a fixed-size frame (the length, then the bytes), and
a second one of the rest when the message is longer than the frame. Replies are one all-gather of fixed-size
frames, and a gather of the overflows only when one is longer. Every collective is posted
asynchronously and waited on with a deadline; a wait that times out or fails (a peer process died) raises
`RankLostError`. A gloo collective that timed out leaves the group unusable, so after one the channel is closed.
`receive(None)` waits up to the group's own timeout (set when the group was made): a driver that may stay idle
longer than that must send something (an empty step) before it elapses.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.ranks.channel import (
    PlanChannel,
    PlanChannelError,
    PlanTooLargeError,
    RankLostError,
)

__all__ = ["DistPlanChannel"]

_GROUP_TIMEOUT_S = 7 * 24 * 3600.0
"""How long a rank waits for its next plan (an idle worker sends none); a driver that dies or hangs is found
sooner: its sockets close, or the driver's own step timeout fails the step."""


class DistPlanChannel(PlanChannel):
    """See the module docstring. Every rank of `group` (a gloo group of the worker's N processes, rank 0 the
    driver) constructs one; messages above `max_message_bytes` raise `PlanTooLargeError` at the sender, and a
    broadcast not taken by every rank within `send_timeout_s` raises `RankLostError`."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        max_message_bytes: int = 64 << 20,
        send_timeout_s: float = 60.0,
        plan_inline_bytes: int = 4 << 10,
        reply_inline_bytes: int = 4 << 10,
    ):
        if dist.get_backend(group) != "gloo":
            raise PlanChannelError(
                f"the plan channel needs a gloo group (CPU tensors), got {dist.get_backend(group)}"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_message_bytes = max_message_bytes
        self.send_timeout_s = send_timeout_s
        """Bound on a broadcast: a large one completes only as the ranks take it."""
        if min(plan_inline_bytes, reply_inline_bytes) <= _LENGTH_BYTES:
            raise ValueError(f"frames must exceed {_LENGTH_BYTES} bytes (the length field)")
        self.plan_inline_bytes, self.reply_inline_bytes = plan_inline_bytes, reply_inline_bytes
        """Frame sizes: a plan (a reply) that fits is one collective; a longer one takes a second."""
        self._src = dist.get_global_rank(group, 0)
        self._closed = False

    @staticmethod
    def new_group(timeout_s: float = _GROUP_TIMEOUT_S) -> dist.ProcessGroup:
        """A gloo group of every process of the default group (called by all of them, in the same order)."""
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def _wait(self, work, timeout_s: float | None, what: str) -> None:
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            self._closed = True
            others = [r for r in range(self.world_size) if r != self.rank]
            raise RankLostError(others, f"{what} failed or timed out: {e}") from e

    def _check(self, max_bytes: int, length: int, what: str) -> None:
        if self._closed:
            raise PlanChannelError("the plan channel is closed")
        if length > max_bytes:
            raise PlanTooLargeError(
                f"{what} of {length} bytes exceeds the channel's {max_bytes} bytes "
                "(raise max_message_bytes)"
            )

    def broadcast(self, message: bytes) -> None:
        if self.rank != 0:
            raise PlanChannelError(f"rank {self.rank} cannot broadcast: only the driver does")
        self._check(self.max_message_bytes, len(message), "plan message")
        head, rest = _frame(message, self.plan_inline_bytes)
        self._bcast(head, self.send_timeout_s, "plan")
        if rest is not None:
            self._bcast(rest, self.send_timeout_s, "plan overflow")

    def _bcast(self, tensor: torch.Tensor, timeout_s: float | None, what: str) -> None:
        work = dist.broadcast(tensor, src=self._src, group=self.group, async_op=True)
        self._wait(work, timeout_s, what)

    def receive(self, timeout_s: float | None) -> bytes | None:
        if self._closed:
            raise PlanChannelError("the plan channel is closed")
        head = torch.empty(self.plan_inline_bytes, dtype=torch.uint8)
        # A rank cannot give up on a posted gloo broadcast and post it again, so a timed-out receive closes
        # the channel like any other failure (no None return on this channel).
        self._bcast(head, timeout_s, "waiting for the plan")
        length, first = _unframe(head)
        if length == len(first):
            return first
        rest = torch.empty(length - len(first), dtype=torch.uint8)
        self._bcast(rest, timeout_s, "plan overflow")
        return first + rest.numpy().tobytes()

    def reply(self, message: bytes) -> None:
        if self.rank == 0:
            raise PlanChannelError("the driver does not reply")
        self._check(self.max_message_bytes, len(message), f"rank {self.rank}'s reply")
        self._gather_bytes(message, None)

    def gather(self, timeout_s: float, check: Callable[[], None] | None = None) -> list[bytes]:
        if self._closed:
            raise PlanChannelError("the plan channel is closed")
        if check is not None:
            check()
        return self._gather_bytes(b"", timeout_s)[1:]

    def _gather_bytes(self, message: bytes, timeout_s: float | None) -> list[bytes]:
        """Every rank's reply at rank 0 (an empty list elsewhere): one all-gather of fixed-size frames, so that
        every rank learns every length, then, only if some reply overflowed its frame, one gather of the
        overflows padded to the longest."""
        head, rest = _frame(message, self.reply_inline_bytes)
        heads = [torch.empty_like(head) for _ in range(self.world_size)]
        work = dist.all_gather(heads, head, group=self.group, async_op=True)
        self._wait(work, timeout_s, "gathering replies")
        framed = [_unframe(h) for h in heads]
        longest_rest = max(length - len(first) for length, first in framed)
        if longest_rest == 0:
            return [first for _, first in framed] if self.rank == 0 else []
        padded = torch.zeros(longest_rest, dtype=torch.uint8)
        if rest is not None:
            padded[: len(rest)] = rest
        bufs = (
            [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        work = dist.gather(padded, bufs, dst=self._src, group=self.group, async_op=True)
        self._wait(work, timeout_s, "gathering reply overflows")
        if self.rank != 0:
            return []
        return [
            first + bufs[r][: length - len(first)].numpy().tobytes()
            for r, (length, first) in enumerate(framed)
        ]

    def close(self) -> None:
        self._closed = True


_LENGTH_BYTES = 8


def _frame(message: bytes, frame_bytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fixed-size frame [length (int64 little-endian) | the message's first bytes | zeros], and the rest of
    the message when it does not fit."""
    fits = frame_bytes - _LENGTH_BYTES
    head = torch.zeros(frame_bytes, dtype=torch.uint8)
    framed = len(message).to_bytes(_LENGTH_BYTES, "little") + message[:fits]
    head[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
    if len(message) <= fits:
        return head, None
    return head, torch.frombuffer(bytearray(message[fits:]), dtype=torch.uint8)


def _unframe(head: torch.Tensor) -> tuple[int, bytes]:
    """(the message's length, the part of it in the frame)."""
    raw = head.numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
    return length, raw[_LENGTH_BYTES : _LENGTH_BYTES + length]
