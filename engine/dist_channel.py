"""`PlanChannel` over a torch.distributed gloo group, for ranks on other nodes than the driver (a GB200 NVL72
worker spans the nodes of one NVLink domain, where shared memory cannot reach).

A broadcast is two gloo broadcasts from the group's rank 0: the length (int64), then the bytes (uint8). Replies
are an all-gather of the lengths, then a gather to rank 0 of the bytes padded to the longest. Every collective is posted
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

from .plan_channel import PlanChannel, PlanChannelError, PlanTooLargeError, RankLostError

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
        length = torch.tensor([len(message)], dtype=torch.int64)
        self._bcast(length, self.send_timeout_s, "plan length")
        if message:
            data = torch.frombuffer(bytearray(message), dtype=torch.uint8)
            self._bcast(data, self.send_timeout_s, "plan bytes")

    def _bcast(self, tensor: torch.Tensor, timeout_s: float | None, what: str) -> None:
        work = dist.broadcast(tensor, src=self._src, group=self.group, async_op=True)
        self._wait(work, timeout_s, what)

    def receive(self, timeout_s: float | None) -> bytes | None:
        if self._closed:
            raise PlanChannelError("the plan channel is closed")
        length = torch.zeros(1, dtype=torch.int64)
        # A rank cannot give up on a posted gloo broadcast and post it again, so a timed-out receive closes
        # the channel like any other failure (no None return on this channel).
        self._bcast(length, timeout_s, "waiting for the plan")
        data = torch.empty(int(length), dtype=torch.uint8)
        if len(data):
            self._bcast(data, timeout_s, "plan bytes")
        return data.numpy().tobytes()

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
        is_root = self.rank == 0
        length = torch.tensor([len(message)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        # all-gather, not gather: every rank pads its reply to the longest, so every rank must know it
        work = dist.all_gather(lengths, length, group=self.group, async_op=True)
        self._wait(work, timeout_s, "gathering reply lengths")
        longest = int(max(lengths).item())
        if longest == 0:
            return [b""] * self.world_size
        data = torch.zeros(longest, dtype=torch.uint8)
        if message:
            data[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        work = dist.gather(data, bufs if is_root else None, dst=self._src, group=self.group,
                           async_op=True)  # fmt: skip
        self._wait(work, timeout_s, "gathering replies")
        if not is_root:
            return []
        return [bufs[r][: int(lengths[r])].numpy().tobytes() for r in range(self.world_size)]

    def close(self) -> None:
        self._closed = True
