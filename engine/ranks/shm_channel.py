"""`PlanChannel` over one shared-memory file (in /dev/shm) for ranks on the driver's node.

The file holds one plan slot, written by the driver, and one reply slot per rank 1..N-1, written by that rank.
A slot is a 64-byte header (sequence number, length, CRC-32 of the sequence number and the data) followed by its
data. A writer stores the data, then length and CRC, then the sequence number; a reader polls the sequence number
and takes the data once it is the one expected and the CRC matches. The CRC is what makes this safe where stores
may become visible out of order (Python has no memory fence; aarch64 hosts such as Grace reorder stores): a reader
that sees the new sequence number before the rest retries. The lock-step contract of `PlanChannel` means a slot is
never rewritten while a reader copies data it has already accepted.

Waiting spins for `spin_s` (yielding the core between polls), then sleeps with a backoff from 20 us up to
`max_sleep_s`, so an idle rank costs almost no CPU and a busy one answers in microseconds.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.ranks.channel import (
    PlanChannel,
    PlanChannelError,
    PlanTooLargeError,
    RankLostError,
)

__all__ = ["ShmPlanChannel", "ShmSpec"]

_MAGIC = 0x70647372616E6B31  # "pdsrank1"
_FILE_HEADER = struct.Struct("<QQQQ")  # magic, world_size, plan_capacity, reply_capacity
_SEQ = struct.Struct("<Q")  # a slot's header: sequence number, then length and CRC-32
_LEN_CRC = struct.Struct("<QI")
_HEADER_BYTES = 64
_CHECK_EVERY_S = 0.01
_FIRST_SLEEP_S = 20e-6
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


class _Slot:
    def __init__(self, buf: memoryview, offset: int, capacity: int):
        self.buf, self.offset, self.capacity = buf, offset, capacity
        self.data_offset = offset + _HEADER_BYTES

    def write(self, seq: int, data: bytes, what: str) -> None:
        if len(data) > self.capacity:
            raise PlanTooLargeError(
                f"{what} of {len(data)} bytes exceeds the shared-memory slot's {self.capacity} bytes "
                "(raise the channel's capacity)"
            )
        self.buf[self.data_offset : self.data_offset + len(data)] = data
        # Whole-field stores from packed bytes (struct.pack_into zeroes its target before filling it), the
        # sequence number last, one aligned 8-byte store.
        self.buf[self.offset + 8 : self.offset + 20] = _LEN_CRC.pack(len(data), _crc(seq, data))
        self.buf[self.offset : self.offset + 8] = _SEQ.pack(seq)

    def read(self, seq: int) -> bytes | None:
        """The data if the slot holds message `seq` completely, else None."""
        (got_seq,) = _SEQ.unpack_from(self.buf, self.offset)
        if got_seq != seq:
            return None
        length, crc = _LEN_CRC.unpack_from(self.buf, self.offset + 8)
        if length > self.capacity:
            return None
        data = bytes(self.buf[self.data_offset : self.data_offset + length])
        return data if _crc(seq, data) == crc else None


def _crc(seq: int, data: bytes) -> int:
    """CRC-32 of the sequence number and the data: a header half written (or zeroed) never matches."""
    return zlib.crc32(data, zlib.crc32(_SEQ.pack(seq)))


class _Backoff:
    def __init__(self, spin_s: float, max_sleep_s: float):
        self.start = time.monotonic()
        self.spin_s, self.max_sleep_s, self.sleep_s = spin_s, max_sleep_s, _FIRST_SLEEP_S

    def pause(self) -> None:
        if time.monotonic() - self.start < self.spin_s:
            os.sched_yield()
            return
        time.sleep(self.sleep_s)
        self.sleep_s = min(self.sleep_s * 2, self.max_sleep_s)


class ShmSpec:
    """What a rank needs to open the driver's channel: plain values, so it crosses to a rank process as msgpack
    (`as_dict` / `from_dict`)."""

    def __init__(self, path: str, world_size: int, plan_capacity: int, reply_capacity: int):
        self.path, self.world_size = path, world_size
        self.plan_capacity, self.reply_capacity = plan_capacity, reply_capacity

    def as_dict(self) -> dict:
        return {
            "path": self.path, "world_size": self.world_size,
            "plan_capacity": self.plan_capacity, "reply_capacity": self.reply_capacity,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ShmSpec:
        return cls(d["path"], d["world_size"], d["plan_capacity"], d["reply_capacity"])

    @property
    def size_bytes(self) -> int:
        return (
            _HEADER_BYTES
            + _HEADER_BYTES + self.plan_capacity
            + (self.world_size - 1) * (_HEADER_BYTES + self.reply_capacity)
        )  # fmt: skip


class ShmPlanChannel(PlanChannel):
    """See the module docstring. The driver makes the file (`create`) and removes it on `close`; ranks `open` it
    from the driver's `spec`. `receive(None)` waits without end (a rank waits for its driver as long as the
    driver lives: the rank loop checks that separately)."""

    def __init__(self, spec: ShmSpec, rank: int, owner: bool, spin_s: float, max_sleep_s: float):
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside [0, {spec.world_size})")
        self.spec, self.world_size, self.rank, self._owner = spec, spec.world_size, rank, owner
        self.spin_s, self.max_sleep_s = spin_s, max_sleep_s
        self._mmap = None
        fd = os.open(spec.path, os.O_RDWR)
        try:
            header = os.pread(fd, _FILE_HEADER.size, 0)
            expected = (_MAGIC, spec.world_size, spec.plan_capacity, spec.reply_capacity)
            if (
                os.fstat(fd).st_size != spec.size_bytes
                or len(header) != _FILE_HEADER.size
                or _FILE_HEADER.unpack(header) != expected
            ):
                raise PlanChannelError(f"{spec.path} is not this worker's plan channel")
            self._mmap = mmap.mmap(fd, spec.size_bytes)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mmap)
        self._plan = _Slot(self._buf, _HEADER_BYTES, spec.plan_capacity)
        first_reply = _HEADER_BYTES + _HEADER_BYTES + spec.plan_capacity
        self._replies = {
            r: _Slot(self._buf, first_reply + (r - 1) * (_HEADER_BYTES + spec.reply_capacity),
                     spec.reply_capacity)
            for r in range(1, spec.world_size)
        }  # fmt: skip
        self._seq = 0
        """The last message sent (driver) or received (rank); sequence numbers start at 1."""

    @classmethod
    def create(
        cls, world_size: int, plan_capacity: int = 1 << 20, reply_capacity: int = 1 << 20,
        spin_s: float = 0.005, max_sleep_s: float = 0.001, directory: Path | None = None,
    ) -> ShmPlanChannel:  # fmt: skip
        """The driver's side: a new zeroed file in /dev/shm (or `directory`) sized for the slots."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if plan_capacity < 1 or reply_capacity < 1:
            raise ValueError(f"capacities must be >= 1 byte, got {plan_capacity}, {reply_capacity}")
        directory = directory or SHM_DIR
        if directory is None:
            raise PlanChannelError("no /dev/shm on this host: use the torch.distributed channel")
        path = str(directory / f"pdserve-plan-{uuid.uuid4().hex}")
        spec = ShmSpec(path, world_size, plan_capacity, reply_capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, spec.size_bytes)
            os.pwrite(fd, _FILE_HEADER.pack(_MAGIC, world_size, plan_capacity, reply_capacity), 0)
        finally:
            os.close(fd)
        return cls(spec, 0, owner=True, spin_s=spin_s, max_sleep_s=max_sleep_s)

    @classmethod
    def open(
        cls, spec: ShmSpec, rank: int, spin_s: float = 0.005, max_sleep_s: float = 0.001
    ) -> ShmPlanChannel:
        """A rank's side of the driver's channel."""
        if rank == 0:
            raise ValueError("rank 0 is the driver: it creates the channel")
        return cls(spec, rank, owner=False, spin_s=spin_s, max_sleep_s=max_sleep_s)

    def _check_open(self) -> None:
        if self._mmap is None:
            raise PlanChannelError("the plan channel is closed")

    def broadcast(self, message: bytes) -> None:
        self._check_open()
        if self.rank != 0:
            raise PlanChannelError(f"rank {self.rank} cannot broadcast: only the driver does")
        self._plan.write(self._seq + 1, message, "plan message")
        self._seq += 1

    def gather(self, timeout_s: float, check: Callable[[], None] | None = None) -> list[bytes]:
        self._check_open()
        pending = dict(self._replies)
        got: dict[int, bytes] = {}
        backoff = _Backoff(self.spin_s, self.max_sleep_s)
        deadline = backoff.start + timeout_s
        next_check = backoff.start + _CHECK_EVERY_S
        while True:
            for r in list(pending):
                data = pending[r].read(self._seq)
                if data is not None:
                    got[r] = data
                    del pending[r]
            if not pending:
                return [got[r] for r in sorted(got)]
            now = time.monotonic()
            if now >= deadline:
                raise RankLostError(
                    sorted(pending), f"no reply to step {self._seq} in {timeout_s} s"
                )
            if check is not None and now >= next_check:
                check()
                next_check = now + _CHECK_EVERY_S
            backoff.pause()

    def receive(self, timeout_s: float | None) -> bytes | None:
        self._check_open()
        backoff = _Backoff(self.spin_s, self.max_sleep_s)
        deadline = None if timeout_s is None else backoff.start + timeout_s
        while True:
            data = self._plan.read(self._seq + 1)
            if data is not None:
                self._seq += 1
                return data
            if deadline is not None and time.monotonic() >= deadline:
                return None
            backoff.pause()

    def reply(self, message: bytes) -> None:
        self._check_open()
        if self.rank == 0:
            raise PlanChannelError("the driver does not reply")
        self._replies[self.rank].write(self._seq, message, f"rank {self.rank}'s reply")

    def unlink(self) -> None:
        """Driver: remove the file's name once every rank has opened it (their mappings keep it alive), so that
        no process death, the driver's included, can leave it behind in /dev/shm."""
        if self._owner:
            Path(self.spec.path).unlink(missing_ok=True)

    def close(self) -> None:
        if self._mmap is None:
            return
        self._plan = None
        self._replies = {}
        self._buf.release()
        self._mmap.close()
        self._mmap = None
        self.unlink()
