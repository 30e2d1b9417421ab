"""The link of one (P, D) pair: its two-rank process group, rebuilt under a new epoch when it breaks, and the
posted operations on it, polled against deadlines.

All the pair's rendezvous goes through the deployment's `SignedStore` (see `store`): its epoch, its ready flags
and its group's own keys (gloo's addresses, NCCL's unique id) are signed values under key names that hold the
pair and the epoch, so a client of the store without the deployment's secret can delete or overwrite them but
never forge or replay one.

Each pair has an epoch in the store: whichever side sees the link fail drops its group and writes the next
epoch, and both sides rebuild under the new epoch's keys on next use. Each side keeps the newest valid epoch it
has seen, so a value that does not verify or an older one (replayed) moves neither. Before building, the two
sides meet in the store (each sets a ready flag and waits, with a timeout, for the other's), so a dead peer costs
a timeout, never a hang. While a side waits it keeps its own flag and the epoch in the store (puts them back when
deleted or overwritten), and it follows the pair to a newer epoch the moment the store shows one. From the meeting
until the group first carries an operation, a guard thread puts back the side's values the same way (a peer may
still be reading them: gloo's peer may finish building first, NCCL exchanges its id on first use). So deleting or
overwriting a key costs the peer a poll or two, not a retry. A peer may still die between its ready flag and its
group: the build then waits in the store for it, up to the connect timeout, on a store client of the pair's own (a
client serves one request at a time), so that no other pair of the process waits with it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pdserve.model.errors import TransferError

from ._wire import HEADER_LEN
from .config import KVTransferConfig
from .store import SignedStore

logger = logging.getLogger(__name__)

POLL_S = 0.00002
"""Sleep between polls after the spin, up to `_FAST_POLL_WINDOW_S`."""
IDLE_POLL_S = 0.002
_FAST_POLL_WINDOW_S = 0.02
CHECK_S = 0.05
_JOIN_POLL_S = 0.005
GUARD_S = 0.02
"""Between the guard's checks of a side's values while its group is being built; afterwards, until the group's
first operation, the interval doubles up to `_GUARD_MAX_S`."""
_GUARD_MAX_S = 1.0
_RETIRED_STORES = 4
"""Group stores kept after their group is dropped: a torch store written in Python must outlive every C++ user
of it (NCCL's threads may still look at theirs for a moment after an abort)."""
SENDER_EPOCH_TTL_S = 1.0
"""How long the prefill side trusts its last read of a pair's epoch (a store round trip on every send would
add a network round trip to each); a failed send re-reads it."""
_MIN_METADATA_BUFFER = 1024
_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1000


def lower_timer_slack() -> None:
    """Lets the calling thread's short sleeps last what they ask (Linux adds up to 50 us to each by default,
    which a polling loop pays on every wake-up). Best effort: a no-op where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        zero = ctypes.c_ulong(0)
        ctypes.CDLL(None).prctl(
            _PR_SET_TIMERSLACK, ctypes.c_ulong(_TIMER_SLACK_NS), zero, zero, zero
        )


class _OnStream:
    """What `torch.cuda.device(d)` with `torch.cuda.stream(s)` do for a stream on device d, through the calls
    beneath them, without the two context managers' own host time on every transfer's path. Restores
    the thread's device, and that device's stream, on exit."""

    __slots__ = ("stream", "prev_device", "prev_stream")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __enter__(self) -> None:
        s = self.stream
        self.prev_device = torch.cuda._exchange_device(s.device_index)
        self.prev_stream = torch._C._cuda_getCurrentStream(s.device_index)
        torch.cuda._set_stream_by_id(s.stream_id, s.device_index, s.device_type)

    def __exit__(self, *exc) -> None:
        torch.cuda._set_stream_by_id(*self.prev_stream)
        torch.cuda._maybe_exchange_device(self.prev_device)


class Scratch:
    """A pair's buffers for its small messages, with their views made once (each tensor slice costs
    microseconds of host time on the path every transfer waits on): the header in host memory (pinned on a
    GPU, with a numpy view to fill it) and on the device, an acknowledgement on the device, and the metadata
    in host memory and on the device (grown to the largest a transfer carried)."""

    def __init__(self, device: torch.device, pinned: bool):
        self.device, self.pinned = device, pinned
        self.host = torch.empty(HEADER_LEN, dtype=torch.int64, pin_memory=pinned)
        self.host_np = self.host.numpy()
        dev = torch.empty(HEADER_LEN + 2, dtype=torch.int64, device=device)
        self.header, self.ack = dev[:HEADER_LEN], dev[HEADER_LEN:]
        self._meta_host = self._meta_dev = torch.empty(0, dtype=torch.uint8)

    def _meta_room(self, n: int) -> None:
        if self._meta_host.numel() >= n:
            return
        size = max(_MIN_METADATA_BUFFER, 1 << (n - 1).bit_length())
        self._meta_host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        on_host = self.device.type == "cpu"
        self._meta_dev = (
            self._meta_host if on_host else torch.empty(size, dtype=torch.uint8, device=self.device)
        )

    def metadata_out(self, data: bytes) -> torch.Tensor:
        """`data` as a uint8 tensor on the device, to send: copied there on the current stream (no host
        wait)."""
        n = len(data)
        self._meta_room(n)
        self._meta_host[:n].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        if self._meta_dev is self._meta_host:
            return self._meta_host[:n]
        return self._meta_dev[:n].copy_(self._meta_host[:n], non_blocking=True)

    def metadata_in(self, n: int) -> torch.Tensor:
        """A uint8[n] buffer on the device to receive metadata into (read it with `metadata_read`)."""
        self._meta_room(n)
        return self._meta_dev[:n]

    def metadata_read(self, n: int) -> bytes:
        """The metadata received into `metadata_in(n)`, once the current stream follows its receive."""
        if self._meta_dev is self._meta_host:
            return self._meta_host[:n].numpy().tobytes()
        return self._meta_dev[:n].cpu().numpy().tobytes()


class PeerAbsent(TransferError):
    """The other side of a pair did not join in time: presumed dead."""


class Pair:
    """One side of the process group of a (P, D) pair, P is rank 0, D is rank 1. Not thread-safe: each user
    holds `lock`. On a GPU it carries a side stream for the copies around the transfers, so that they never
    queue behind the worker's forward passes (on the default stream)."""

    def __init__(
        self, store, prefill_id: str, decode_id: str, rank: int, backend: str,
        config: KVTransferConfig, device: torch.device,
    ):  # fmt: skip
        if not isinstance(store, SignedStore):
            raise TypeError(
                f"a KV pair needs the deployment's SignedStore (kvtransfer.store.connect_store), not "
                f"{type(store).__name__}: an unsigned store lets any client of it move the pair's keys"
            )
        self.store, self.rank, self.backend, self.config = store, rank, backend, config
        self.key = f"pdkv/{prefill_id}/{decode_id}"
        self._epoch_key = f"{self.key}/epoch"
        self.peer = decode_id if rank == 0 else prefill_id
        self.lock = threading.Lock()
        self.group: dist.ProcessGroup | None = None
        self.epoch = -1
        self._epoch_read_at = -float("inf")
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._scratch: Scratch | None = None
        self.gone = False
        """The peer was lost for good (set from any thread): connecting fails at once."""
        self._seen_epoch = -1
        """The newest valid epoch read from the store or written here: the store's value counts only above it."""
        self._group_store: SignedStore | None = None
        self._retired: collections.deque[SignedStore] = collections.deque(maxlen=_RETIRED_STORES)
        self._guard_stop: threading.Event | None = None

    def on_device(self) -> contextlib.AbstractContextManager:
        """Makes the pair's device and side stream current for the calling thread (both are per thread)."""
        return _OnStream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def scratch(self) -> Scratch:
        """Buffers kept for the pair's small messages (header, ack). A pair carries one transfer at a time, and
        a transfer's operations are complete (or, after a failure, its stream synchronized) before the next
        begins, so they are free to reuse."""
        if self._scratch is None:
            self._scratch = Scratch(self.device, pinned=self.stream is not None)
        return self._scratch

    def _stored_epoch(self, store: SignedStore | None = None) -> int | None:
        """The epoch the store holds, if its value verifies (None: missing, forged or copied)."""
        value = (store or self.store).read(self._epoch_key)
        try:
            return int(value) if value is not None else None
        except ValueError:  # signed by a worker of this deployment, so never; but no crash on it
            return None

    def current_epoch(self) -> int:
        """The pair's newest epoch: the store's when it verifies and is newer than any seen here."""
        self._epoch_read_at = time.monotonic()
        stored = self._stored_epoch()
        if stored is not None and stored > self._seen_epoch:
            self._seen_epoch = stored
        return max(self._seen_epoch, 0)

    def epoch_moved(self) -> bool:
        return self.current_epoch() > self.epoch

    def connect(self, epoch_ttl_s: float = 0.0) -> dist.ProcessGroup:
        """The pair's group for the current epoch, building it (meeting the peer) when needed. With
        `epoch_ttl_s`, an epoch read that recently is trusted without asking the store."""
        if self.gone:
            raise PeerAbsent(f"{self.peer} was lost")
        fresh = time.monotonic() - self._epoch_read_at < epoch_ttl_s
        if self.group is not None and fresh:
            return self.group
        epoch = self.current_epoch()
        if self.group is not None and epoch == self.epoch:
            return self.group
        self.drop()
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            epoch = self._meet(epoch, deadline)
            try:
                self.group = self._build(epoch, deadline)
            except RuntimeError as e:
                # torch's store and network errors here: the peer went away while joining, or moved on
                self.drop()
                newer = self.current_epoch()
                if newer > epoch and not self.gone and time.monotonic() < deadline:
                    epoch = newer  # the peer gave this epoch up: follow it
                    continue
                self.fail()  # both sides build afresh, under a new epoch's keys
                raise PeerAbsent(f"{self.peer} joined the KV link but did not build it: {e}") from e
            self.epoch = epoch
            return self.group

    def _meet(self, epoch: int, deadline: float) -> int:
        """Sets our ready flag under `epoch` and waits for the peer's, following the pair to any newer epoch the
        store shows; returns the epoch at which both are ready. While waiting, puts back our flag and the epoch
        when they are missing or do not verify (deleted or overwritten by another client of the store)."""
        mine = f"{self.key}/{epoch}/ready{self.rank}"
        self.store.set(mine, "1")
        # Polled, not one long wait: the store client is shared by the process's threads and serves one request
        # at a time, so a long wait would hold up every other pair's epoch checks.
        while self.store.read(f"{self.key}/{epoch}/ready{1 - self.rank}") is None:
            if self.gone:
                raise PeerAbsent(f"{self.peer} was lost")
            if time.monotonic() > deadline:
                raise PeerAbsent(
                    f"{self.peer} did not join the KV link within {self.config.connect_timeout_s:g}s"
                )
            stored = self._stored_epoch()
            if stored is not None and stored > epoch:
                # the peer moved on (or failed first): follow it
                epoch = self._seen_epoch = max(stored, self._seen_epoch)
                mine = f"{self.key}/{epoch}/ready{self.rank}"
                self.store.set(mine, "1")
                continue
            if stored is None or stored < epoch:
                self.store.set(self._epoch_key, str(epoch))
            if self.store.read(mine) is None:
                self.store.set(mine, "1")
            time.sleep(_JOIN_POLL_S)
        return epoch

    def _build(self, epoch: int, deadline: float) -> dist.ProcessGroup:
        """The group of `epoch`, built through a signed view of a store client of its own, whose waits give up
        once the pair is lost or the store shows a newer epoch (the peer gave this one up). A guard thread puts
        back our values (ready flag, the group's own keys) until the group's first operation (`settled`)."""
        raw = self._own_client()
        probe = self.store.view(raw=raw)
        stop = threading.Event()

        def abort() -> bool:
            if self.gone or stop.is_set():
                return True
            stored = self._stored_epoch(probe)
            return stored is not None and stored > epoch

        remaining = max(deadline - time.monotonic(), 0.001)
        epoch_view = self.store.view(raw=raw, prefix=f"{self.key}/{epoch}/", keep=True)
        epoch_view.set(f"ready{self.rank}", "1")
        group_store = epoch_view.view(prefix="g/", keep=True, abort=abort, timeout_s=remaining)
        self._group_store, self._guard_stop = group_store, stop
        building = threading.Event()
        building.set()
        threading.Thread(
            target=_guard, args=((epoch_view, group_store), stop, building), daemon=True,
            name=f"kv-guard-{self.peer}",
        ).start()  # fmt: skip
        try:
            if self.backend == "nccl":  # its communicator is set up through the store on first use
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=self.config.idle_timeout_s)
                return dist.ProcessGroupNCCL(group_store, self.rank, 2, options)
            # Gloo meets the peer in the store now, waiting up to the connect timeout's rest; each operation
            # waits with its own timeout (`Op`).
            return dist.ProcessGroupGloo(group_store, self.rank, 2, timedelta(seconds=remaining))
        finally:
            building.clear()

    def settled(self) -> None:
        """The group carried an operation: both sides are past its rendezvous, so the guard stops."""
        if self._guard_stop is not None:
            self._guard_stop.set()

    def _own_client(self) -> dist.Store:
        """A new client of the shared store for one group (kept while the group lives: NCCL sets up its
        communicator through it on first use): the build's waits for the peer, up to the connect timeout,
        then hold up no other pair's store requests."""
        raw = self.store.raw
        if not isinstance(raw, dist.TCPStore):
            return raw
        return dist.TCPStore(
            raw.host, raw.port, is_master=False,
            timeout=timedelta(seconds=self.config.connect_timeout_s), wait_for_workers=False,
        )  # fmt: skip

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Holds `lock`, waiting for it only while the peer is not lost: a send queued behind one that is
        building the link to a peer that died fails as soon as the peer is forgotten."""
        while not self.lock.acquire(timeout=CHECK_S):
            if self.gone:
                raise PeerAbsent(f"{self.peer} was lost")
        try:
            yield
        finally:
            self.lock.release()

    def send(self, tensor: torch.Tensor, tag: int) -> Op:
        work = self.group.send([tensor], 1 - self.rank, tag)
        return Op(work, self.group, self.backend, self.config.idle_timeout_s)

    def recv(self, tensor: torch.Tensor, tag: int) -> Op:
        work = self.group.recv([tensor], 1 - self.rank, tag)
        return Op(work, self.group, self.backend, self.config.idle_timeout_s)

    def drop(self) -> None:
        self.settled()  # no more guarding of the dropped group's values
        if self.group is not None and self.backend == "nccl":
            try:
                self.group.abort()
            except Exception:  # already broken: nothing more to release
                logger.debug("abort of %s failed", self.key, exc_info=True)
        if self._group_store is not None:
            self._retired.append(self._group_store)
        self.group = self._group_store = self._guard_stop = None

    def fail(self) -> None:
        """The link is unusable: drop our side and move both sides to a new epoch (the newest seen, plus one)."""
        self.drop()
        self._epoch_read_at = -float("inf")
        self._seen_epoch = self.current_epoch() + 1
        self.store.set(self._epoch_key, str(self._seen_epoch))


def _guard(
    views: tuple[SignedStore, ...], stop: threading.Event, building: threading.Event
) -> None:
    """Puts back what `views` set and lost (`SignedStore.heal`) until `stop`: every `GUARD_S` while `building`,
    then less and less often."""
    interval = GUARD_S
    while not stop.wait(interval):
        try:
            for view in views:
                view.heal()
        except Exception:
            # the store is unreachable: nothing to put back now, and the build fails on its own
            logger.debug("KV guard: store unreachable", exc_info=True)
        if not building.is_set():
            interval = min(interval * 2, _GUARD_MAX_S)


class Op:
    """A posted send or receive that can be polled. NCCL works report completion themselves; a gloo work only
    completes inside `wait()` (and a timed-out wait closes the pair), so a helper thread waits on it."""

    def __init__(self, work, group: dist.ProcessGroup, backend: str, timeout_s: float):
        """timeout_s: how long a gloo operation may stay posted (an NCCL one: its group's timeout)."""
        self.work, self.error = work, None
        self.in_order = backend == "nccl"
        """NCCL runs a pair's operations on one stream in posting order: one completing implies that every
        operation posted before it did."""
        self._done: threading.Event | None = None
        if backend == "gloo":
            self._done = threading.Event()
            # The thread holds the group: it stays alive until the wait ends, even if abandoned.
            timeout = timedelta(seconds=timeout_s)
            threading.Thread(target=self._wait_gloo, args=(group, timeout), daemon=True).start()

    def _wait_gloo(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        try:
            self.work.wait(timeout)
        except Exception as e:  # reported by wait()
            self.error = e
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set() if self._done is not None else self.work.is_completed()

    def wait(self) -> None:
        """After completion: raises the op's error; on NCCL, orders the current stream after the op."""
        if self._done is None:
            self.work.wait()
        elif self.error is not None:
            raise self.error


class Backoff:
    """Pacing of a polling loop: spins for `spin_s` (`os.sched_yield` between polls, which releases the GIL),
    then sleeps `POLL_S` until `_FAST_POLL_WINDOW_S`, then `idle_s`."""

    def __init__(self, spin_s: float, idle_s: float = IDLE_POLL_S):
        self.start, self.spin_s, self.idle_s = time.monotonic(), spin_s, idle_s

    def pause(self, now: float) -> None:
        waited = now - self.start
        if waited < self.spin_s:
            os.sched_yield()
        else:
            time.sleep(POLL_S if waited < _FAST_POLL_WINDOW_S else self.idle_s)


def wait_ops(
    ops: list[Op], deadline: float, what: str, spin_s: float,
    check: Callable[[], bool] | None = None, idle_s: float = IDLE_POLL_S,
) -> bool:  # fmt: skip
    """Polls `ops` until all complete, then waits on each (see `Op.wait`); raises TransferError at `deadline`
    or on a failed op. Every `CHECK_S`, `check()` may return True to give up waiting (the call then returns
    False). Ops that run in order are watched through the last one (each poll and wait costs microseconds)."""
    if ops and all(op.in_order for op in ops):
        ops = ops[-1:]
    backoff = Backoff(spin_s, idle_s)
    next_check = backoff.start + CHECK_S
    pending = list(ops)
    while pending:
        pending = [op for op in pending if not op.is_completed()]
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            raise TransferError(f"{what} timed out")
        if check is not None and now >= next_check:
            if check():
                return False
            next_check = now + CHECK_S
        backoff.pause(now)
    for op in ops:
        try:
            op.wait()
        except Exception as e:
            raise TransferError(f"{what} failed: {e}") from e
    return True


def backend_for(config: KVTransferConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


def sync(stream) -> None:
    if stream is not None:
        stream.synchronize()
