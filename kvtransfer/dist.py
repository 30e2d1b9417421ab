"""The KV transfer over torch.distributed: one two-rank process group per (P, D) pair (see `_link`), NCCL for CUDA
caches, gloo for CPU ones.

Wire format: see `_wire`.

Pipelining. P posts the header first, then gathers piece i from its scattered cache pages on a side stream and
posts its send; NCCL runs the sends in order, so the gather of piece i + 1 overlaps the send of piece i. D posts
the receives of all pieces as soon as the header is in, and scatters each piece into its cache pages (one kernel
for all of a piece's layers) while the next is on the wire. Only the first gather and the last scatter are not
hidden behind the link, and pieces start and end with a single layer to keep those short.

D decides each piece's scatter on the host, after the piece arrived and under the receiver's lock, so a
`cancel` stops all further writes at once; it then waits for the writes already queued (pieces that arrived:
microseconds), never for the link.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.model.errors import TransferError

from ._link import (
    CHECK_S,
    IDLE_POLL_S,
    POLL_S,
    Backoff,
    Op,
    Pair,
    PeerAbsent,
    lower_timer_slack,
    wait_ops,
)
from ._wire import (
    ACK_DISCARDED,
    ACK_OK,
    HEADER_LEN,
    MAGIC,
    TAG_ACK,
    TAG_HEADER,
    TAG_PAGES,
    chunk_plan,
)
from .base import ExpectedTransfer, KVReceiver, KVSender, TransferResult
from .config import KVTransferConfig
from .pages import device_ids, gather_pages, scatter_pages

logger = logging.getLogger(__name__)

_SENDER_EPOCH_TTL_S = 1.0
"""How long the prefill side trusts its last read of a pair's epoch (a store round trip per send would cost
~0.2 ms); a failed send re-reads it."""
_RETIRE_UNEXPECTED_S = 3.0
"""How long D keeps a header receive posted once nothing is expected from its peer any more (the request was
cancelled before P sent it) before it retires the link. A posted NCCL receive occupies D's device until it
completes, so that a device-wide wait there (CUDA-graph capture, the allocator returning memory) would wait for
a transfer that is not coming. Longer than `_SENDER_EPOCH_TTL_S`, so that P re-reads the epoch on its next
send and rebuilds the link with D."""


def connect_store(config: KVTransferConfig, is_master: bool) -> dist.TCPStore:
    """The shared store; exactly one process of the deployment hosts it (`is_master`)."""
    return dist.TCPStore(
        config.store_host,
        config.store_port,
        is_master=is_master,
        timeout=timedelta(seconds=config.connect_timeout_s),
        wait_for_workers=False,
    )


def _backend(config: KVTransferConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _check_pages(page_ids: list[int], num_pages: int, what: str) -> None:
    """The page copies index the cache without bounds checks on the device: check the ids here."""
    if page_ids and not (min(page_ids) >= 0 and max(page_ids) < num_pages):
        raise ValueError(f"{what}: page ids outside the cache's {num_pages} pages")


def _sync(stream) -> None:
    if stream is not None:
        stream.synchronize()


@dataclasses.dataclass(frozen=True, slots=True)
class SendProfile:
    """Where the time of the last successful `send` to a peer went (host clock, seconds from entering `send`)."""

    started_at: float
    """time.monotonic() on entering `send` (the same clock as `TransferResult.completed_at` on D's host)."""
    posted_s: float
    """Every piece gathered (queued) and every operation posted."""
    done_s: float
    """The acknowledgement read."""
    num_pieces: int


class DistKVSender(KVSender):
    """Prefill side: a group per decode peer, one transfer at a time per peer."""

    delay_after_header_s: float = 0.0
    """Fault injection for tests: stall this long between the header and the pages."""

    def __init__(self, config: KVTransferConfig, store, worker_id: str, device: torch.device):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.device, self.backend = torch.device(device), _backend(config, torch.device(device))
        self._pairs: dict[str, Pair] = {}
        self._lock = threading.Lock()
        self.last_profile: dict[str, SendProfile] = {}

    def _pair(self, peer: str) -> Pair:
        with self._lock:
            if peer not in self._pairs:
                self._pairs[peer] = Pair(
                    self.store, self.worker_id, peer, 0, self.backend, self.config, self.device
                )
            return self._pairs[peer]

    def connect(self, peer: str) -> None:
        pair = self._pair(peer)

        def build() -> None:
            with pair.lock, pair.on_device():
                try:
                    pair.connect()
                except TransferError as e:
                    logger.warning("%s", e)

        threading.Thread(target=build, daemon=True, name=f"kv-connect-{peer}").start()

    def send(
        self, peer: str, transfer_id: int, cache: torch.Tensor, page_ids: list[int],
        num_tokens: int, first_token: int,
    ) -> None:  # fmt: skip
        start = time.monotonic()
        pair = self._pair(peer)
        num_layers, num_cache_pages, page_size, dim = cache.shape
        layer_bytes = len(page_ids) * page_size * dim * cache.element_size()
        what = f"KV transfer {transfer_id} ({num_layers * layer_bytes} bytes) to {peer}"
        _check_pages(page_ids, num_cache_pages, what)
        if num_layers * layer_bytes <= self.config.pipeline_min_bytes:
            chunk_layers = num_layers
        else:
            chunk_layers = min(num_layers - 1, max(1, self.config.chunk_bytes // layer_bytes))
        plan = chunk_plan(num_layers, chunk_layers)
        fields = [
            MAGIC, transfer_id, len(page_ids), num_tokens, first_token,
            num_layers, page_size, dim, cache.element_size(), chunk_layers,
        ]  # fmt: skip
        with pair.lock, pair.on_device():
            pair.connect(epoch_ttl_s=_SENDER_EPOCH_TTL_S)
            deadline = time.monotonic() + self.config.timeout_s
            try:
                # The header and the page ids in one copy to the device; the header goes first: D learns the
                # size from it, and posts its receives while we gather.
                fields_dev = device_ids(fields + page_ids, self.device)
                ops = [pair.send(fields_dev[:HEADER_LEN], TAG_HEADER)]
                ids = fields_dev[HEADER_LEN:]
                ack = torch.empty(2, dtype=torch.int64, device=self.device)
                if self.delay_after_header_s:
                    wait_ops(ops, deadline, what, self.config.spin_s)
                    time.sleep(self.delay_after_header_s)
                pieces = []  # referenced until the sends complete
                for first, stop in plan:
                    pieces.append(gather_pages(cache, first, stop, ids))  # [k, n, S, D]
                    ops.append(pair.send(pieces[-1], TAG_PAGES))
                ops.append(pair.recv(ack, TAG_ACK))
                posted = time.monotonic()
                wait_ops(ops, deadline, what, self.config.spin_s)
                ack_id, status = ack.tolist()
            except Exception as e:
                pair.fail()
                _sync(pair.stream)  # no gather may still read pages the caller frees on our return
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"{what} failed: {e}") from e
        if ack_id != transfer_id or status not in (ACK_OK, ACK_DISCARDED):
            raise TransferError(f"{what}: bad acknowledgement {[ack_id, status]}")
        now = time.monotonic()
        self.last_profile[peer] = SendProfile(start, posted - start, now - start, len(plan))

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.drop()
            self._pairs.clear()


class _Wait(enum.Enum):
    HEADER = "a header arrived"
    STOPPED = "closing, or the peer's epoch moved"
    STALE = "the receive has been posted for half the group's timeout, or long after nothing was expected"


@dataclasses.dataclass
class _Peer:
    pair: Pair
    thread: threading.Thread
    wake: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set by `expect`: the idle receiving thread posts the header receive at once."""


class DistKVReceiver(KVReceiver):
    """Decode side: a receiving thread per prefill peer, started when the first transfer from it is expected.
    Writes into `cache` [num_layers, num_pages, page_size, dim], only at expected transfers' pages."""

    def __init__(self, config: KVTransferConfig, store, worker_id: str, cache: torch.Tensor):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.cache = cache
        self.device, self.backend = cache.device, _backend(config, cache.device)
        self._expected: dict[int, ExpectedTransfer] = {}
        self._dropped: dict[int, tuple[str, float]] = {}
        """Transfers cancelled or failed here that P may still send: id -> (peer, until when we keep a header
        receive posted for them, so that P is answered, not left to time out)."""
        self._writes: dict[int, torch.cuda.Event] = {}
        """Last page write queued for a transfer under way (GPU only); guarded by _lock."""
        self._results: list[TransferResult] = []
        # Guards _expected, _dropped, _writes, _results and queuing page writes.
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = threading.Event()

    def expect(self, transfer: ExpectedTransfer) -> None:
        _check_pages(transfer.dest_pages, self.cache.shape[1], f"transfer {transfer.transfer_id}")
        with self._lock:
            self._expected[transfer.transfer_id] = transfer
            if transfer.peer not in self._peers:
                pair = Pair(
                    self.store, transfer.peer, self.worker_id, 1, self.backend, self.config,
                    self.device,
                )  # fmt: skip
                thread = threading.Thread(
                    target=self._receive_loop, args=(transfer.peer, pair), daemon=True,
                    name=f"kv-recv-{transfer.peer}",
                )  # fmt: skip
                self._peers[transfer.peer] = _Peer(pair, thread)
                thread.start()
            self._peers[transfer.peer].wake.set()

    def cancel(self, transfer_id: int) -> None:
        with self._lock:
            self._drop(transfer_id)
            write = self._writes.pop(transfer_id, None)
        if write is not None:
            write.synchronize()  # pieces that had arrived: no write is queued after this

    def poll(self) -> list[TransferResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        self._closed.set()
        for peer in list(self._peers.values()):
            peer.thread.join(timeout=5)
            peer.pair.drop()

    # The receiving thread of one peer.

    def _drop(self, transfer_id: int) -> None:
        """No longer expects `transfer_id` (under _lock)."""
        transfer = self._expected.pop(transfer_id, None)
        if transfer is not None:
            self._dropped[transfer_id] = (transfer.peer, time.monotonic() + _RETIRE_UNEXPECTED_S)

    def _expecting_from(self, peer: str, besides: int | None = None) -> bool:
        """Whether a transfer other than `besides` may still come from `peer`: expected, or dropped lately."""
        now = time.monotonic()
        with self._lock:
            for transfer_id, (_, until) in list(self._dropped.items()):
                if until < now:
                    del self._dropped[transfer_id]
            if any(t.peer == peer and t.transfer_id != besides for t in self._expected.values()):
                return True
            return any(p == peer and i != besides for i, (p, _) in self._dropped.items())

    def _fail_expected(self, peer: str, reason: str, overdue_only: bool) -> None:
        """Reports as failed the transfers expected from `peer` (only those past their deadline, if asked).
        Called from `peer`'s thread between transfers or after it stopped queuing writes."""
        now = time.monotonic()
        writes = []
        with self._lock:
            for t in [t for t in self._expected.values() if t.peer == peer]:
                if overdue_only and t.deadline >= now:
                    continue
                self._drop(t.transfer_id)
                writes.append(self._writes.pop(t.transfer_id, None))
                self._results.append(TransferResult(t.transfer_id, error=reason))
        for write in writes:
            if write is not None:
                write.synchronize()

    def _fail_overdue(self, peer: str, reason: str) -> None:
        self._fail_expected(peer, reason, overdue_only=True)

    def _fail_all(self, peer: str, reason: str) -> None:
        self._fail_expected(peer, reason, overdue_only=False)

    def _receive_loop(self, peer: str, pair: Pair) -> None:
        lower_timer_slack()
        with pair.on_device():
            self._serve_peer(peer, pair, self._peers[peer].wake)

    def _post_header(self, pair: Pair) -> tuple[torch.Tensor, Op]:
        """Posts the receive of the next header: its buffer and the operation."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        return header, pair.recv(header, TAG_HEADER)

    def _serve_peer(self, peer: str, pair: Pair, wake: threading.Event) -> None:
        header, header_op = None, None
        idle_reason = f"no KV pages from {peer} before the deadline"
        while not self._closed.is_set():
            try:
                if header_op is None:
                    # A header receive is posted only while a transfer from the peer is expected: a posted
                    # NCCL receive holds D's device until its message comes (see _RETIRE_UNEXPECTED_S).
                    if not self._expecting_from(peer):
                        wake.wait(IDLE_POLL_S * 25)
                        wake.clear()
                        continue
                    if pair.group is None:
                        pair.connect()
                    header, header_op = self._post_header(pair)
                outcome = self._wait_header(peer, pair, header_op, idle_reason)
                if outcome is not _Wait.HEADER:
                    if outcome is _Wait.STALE:
                        # Retire the link, which withdraws the posted receive (and, past the group's timeout,
                        # NCCL's watchdog would take the whole process down). P re-reads the epoch on its next
                        # send and rebuilds the link with us.
                        pair.fail()
                    elif not self._closed.is_set():
                        pair.drop()  # the peer moved to a new epoch; rebuild on the next pass
                    header_op = None
                    continue
                header, header_op = self._receive_one(peer, pair, header)
            except PeerAbsent as e:
                # It never joined: every transfer expected from it fails now.
                logger.warning("%s", e)
                header_op = None
                self._fail_all(peer, str(e))
            except TransferError as e:
                logger.warning("KV link from %s failed: %s", peer, e)
                header_op = None
                pair.fail()
                self._fail_overdue(peer, str(e))
            except Exception as e:  # thread boundary: report, rebuild the link, keep serving
                logger.error("KV receiver for %s crashed", peer, exc_info=True)
                header_op = None
                pair.fail()
                _sync(pair.stream)
                self._fail_all(peer, f"KV receiver error: {e}")

    def _wait_header(self, peer: str, pair: Pair, header_op: Op, idle_reason: str) -> _Wait:
        """Waits for the next header (posted just before): how the wait ended. Polls briskly while a transfer
        from `peer` is expected (the header's latency is a round trip every transfer pays), slowly otherwise;
        fails the expected transfers that pass their deadlines."""
        backoff = Backoff(self.config.spin_s)
        next_check, expecting = backoff.start + CHECK_S, True
        stale_at = backoff.start + self.config.idle_timeout_s / 2
        unexpected_since = None
        while not header_op.is_completed():
            now = time.monotonic()
            if now >= next_check:
                self._fail_overdue(peer, idle_reason)
                if self._closed.is_set() or pair.epoch_moved():
                    return _Wait.STOPPED
                expecting = self._expecting_from(peer)
                if expecting:
                    unexpected_since = None
                elif unexpected_since is None:
                    unexpected_since = now
                if now >= stale_at or (
                    unexpected_since is not None and now - unexpected_since >= _RETIRE_UNEXPECTED_S
                ):
                    return _Wait.STALE
                next_check = now + CHECK_S
            if now - backoff.start < backoff.spin_s:
                backoff.pause(now)
            elif expecting:
                time.sleep(POLL_S)
            else:
                time.sleep(IDLE_POLL_S)
                expecting = self._expecting_from(peer)  # a request just admitted: speed up at once
        wait_ops([header_op], float("inf"), f"header from {peer}", 0.0)
        return _Wait.HEADER

    def _receive_one(
        self, peer: str, pair: Pair, header_dev: torch.Tensor
    ) -> tuple[torch.Tensor | None, Op | None]:
        """Receives the transfer whose header arrived; returns the next header's buffer and its posted
        receive (both None when no other transfer from the peer is expected)."""
        header = header_dev.tolist()
        magic, transfer_id, num_pages, num_tokens, first_token = header[:5]
        layers, page_size, dim, itemsize, chunk_layers = header[5:]
        sizes = (num_pages, layers, page_size, dim, chunk_layers)
        if magic != MAGIC or itemsize != self.cache.element_size() or min(sizes) <= 0:
            raise TransferError(f"garbled or incompatible header from {peer}: {header}")
        what = f"KV transfer {transfer_id} from {peer}"
        with self._lock:  # it came: no receive is kept posted for it any more
            self._dropped.pop(transfer_id, None)
        deadline = time.monotonic() + self.config.timeout_s
        plan = chunk_plan(layers, chunk_layers)
        staging = torch.empty(
            (layers, num_pages, page_size, dim), dtype=self.cache.dtype, device=self.device
        )
        ops = [pair.recv(staging[first:stop], TAG_PAGES) for first, stop in plan]
        # While the pieces travel: the page ids and both possible acks, so that little is left to do after
        # the last piece.
        dest = self._destination(transfer_id, num_pages, (layers, page_size, dim), what)
        acks = device_ids([transfer_id, ACK_OK, transfer_id, ACK_DISCARDED], self.device).view(2, 2)
        try:
            for op, (first, stop) in zip(ops, plan, strict=True):
                # After this wait our (side) stream follows the piece's receive.
                wait_ops([op], deadline, what, self.config.spin_s)
                if dest is not None:
                    dest = self._write_piece(transfer_id, dest, first, stop, staging)
        except TransferError as e:
            _sync(pair.stream)
            with self._lock:
                self._writes.pop(transfer_id, None)
                if self._expected.pop(transfer_id, None) is not None:
                    self._results.append(TransferResult(transfer_id, error=str(e)))
            raise
        # Report first (the decode worker waits on it), then acknowledge; then, if another transfer from the peer
        # is expected, post the next header's receive, so that a transfer queued behind this one on P finds it.
        with self._lock:
            write = self._writes.pop(transfer_id, None)
            if write is not None:
                write.synchronize()
            if dest is not None and self._expected.pop(transfer_id, None) is not None:
                self._results.append(
                    TransferResult(
                        transfer_id, num_tokens, first_token, completed_at=time.monotonic()
                    )
                )
        ack_op = pair.send(acks[0 if dest is not None else 1], TAG_ACK)
        next_header = None, None
        if self._expecting_from(peer, besides=transfer_id):
            next_header = self._post_header(pair)
        wait_ops([ack_op], deadline, f"ack of {what}", self.config.spin_s)
        return next_header

    def _destination(
        self, transfer_id: int, num_pages: int, layout: tuple[int, int, int], what: str
    ) -> torch.Tensor | None:
        """The device page ids to write the transfer into; None to discard it (not expected, or not fitting:
        then it is reported failed). Either way the pieces are received, so the pair stays usable."""
        with self._lock:
            expected = self._expected.get(transfer_id)
            if expected is None:
                return None
            cache_layout = (self.cache.shape[0], self.cache.shape[2], self.cache.shape[3])
            error = None
            if len(expected.dest_pages) != num_pages:
                error = f"{what}: {num_pages} pages for {len(expected.dest_pages)} reserved"
            elif layout != cache_layout:
                error = f"{what}: pages of layout {layout}, the cache's is {cache_layout}"
            if error is not None:
                del self._expected[transfer_id]
                self._results.append(TransferResult(transfer_id, error=error))
                return None
            pages = expected.dest_pages
        return device_ids(pages, self.device)

    def _write_piece(
        self, transfer_id: int, dest: torch.Tensor, first: int, stop: int, staging: torch.Tensor
    ) -> torch.Tensor | None:
        """Queues the scatter of layers [first, stop) into the transfer's pages, unless it was cancelled or
        failed meanwhile; returns `dest`, or None once the transfer is no longer expected."""
        with self._lock:
            if transfer_id not in self._expected:
                return None
            scatter_pages(self.cache, first, stop, dest, staging[first:stop])
            if self.device.type == "cuda":
                write = torch.cuda.Event()
                write.record()
                self._writes[transfer_id] = write
        return dest
