"""The decode side of the KV transfer over torch.distributed (see `dist` for the whole protocol): a receiving
thread per prefill peer, which posts a header receive while a transfer from that peer may come, then the
metadata's receive and the pieces', in place or packed, and acknowledges. One file past 500 lines: it is one
state machine per peer (header, metadata, pieces, acknowledgement, discard) over one table of expected transfers,
and each stage reads and writes what the others do."""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time

import torch

from pdserve.model.errors import TransferError

from ._link import (
    CHECK_S,
    IDLE_POLL_S,
    POLL_S,
    Backoff,
    Op,
    Pair,
    PeerAbsent,
    backend_for,
    lower_timer_slack,
    sync,
    wait_ops,
)
from ._wire import (
    ACK_DISCARDED,
    ACK_OK,
    CUT_AT_RECEIVER_RUNS,
    MAGIC,
    TAG_ACK,
    TAG_HEADER,
    TAG_METADATA,
    TAG_PAGES,
    chunk_plan,
    pieces_at,
)
from .base import MAX_METADATA_BYTES, ExpectedTransfer, KVReceiver, TransferResult
from .config import KVTransferConfig
from .pages import check_pages, device_ids, in_run, run_breaks, run_view, scatter_pages

logger = logging.getLogger(__name__)

_RETIRE_UNEXPECTED_S = 3.0
"""How long D keeps a header receive posted once nothing is expected from its peer any more (the request was
cancelled before P sent it) before it retires the link. A posted NCCL receive occupies D's device until it
completes, so that a device-wide wait there (CUDA-graph capture, the allocator returning memory) would wait for
a transfer that is not coming. Longer than `SENDER_EPOCH_TTL_S`, so that P re-reads the epoch on its next
send and rebuilds the link with D."""
_CANCEL_GRACE_S = 0.5
"""How long D lets pieces of a cancelled transfer keep arriving in place before it tears down the link to stop
them (only when P stalls mid-transfer: the rest of a transfer takes milliseconds)."""


class _Wait(enum.Enum):
    HEADER = "a header arrived"
    STOPPED = "closing, or the peer's epoch moved"
    STALE = "the receive has been posted for half the group's timeout, or long after nothing was expected"


@dataclasses.dataclass
class _Header:
    """A posted header receive. On a GPU the header's copy to pinned host memory is queued behind the receive
    when it is posted, so that once it arrives reading it costs no device round trip."""

    op: Op
    data: torch.Tensor
    """Where the header is read: the pinned host copy on a GPU, the received buffer on a CPU."""
    copied: torch.cuda.Event | None

    def fields(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.data.tolist()


@dataclasses.dataclass
class _Peer:
    pair: Pair
    thread: threading.Thread
    wake: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set by `expect`: the idle receiving thread posts the header receive at once."""


class DistKVReceiver(KVReceiver):
    """Decode side: a receiving thread per prefill peer, started when the first transfer from it is expected.
    Writes into `cache` [num_pages, num_layers, page_size, dim] (page-major), only at expected transfers' pages."""

    def __init__(self, config: KVTransferConfig, store, worker_id: str, cache: torch.Tensor):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.cache = cache
        self.device, self.backend = cache.device, backend_for(config, cache.device)
        self.in_place = self.backend == "nccl"
        """Receive runs of pages straight into the cache; as `DistKVSender.in_place`."""
        self._expected: dict[int, ExpectedTransfer] = {}
        self._dropped: dict[int, tuple[str, float]] = {}
        """Transfers cancelled or failed here that P may still send: id -> (peer, until when we keep a header
        receive posted for them, so that P is answered, not left to time out)."""
        self._writes: dict[int, torch.cuda.Event] = {}
        """Last page write queued for a transfer under way (GPU only); guarded by _lock."""
        self._breaks: dict[int, list[int] | None] = {}
        """`run_breaks` of each expected transfer's pages (None: not moved in place), kept until its header
        comes or, once dropped, until it is forgotten: P may still send a dropped transfer cut at them (the
        cuts `expect` advised), and D must receive every piece; guarded by _lock."""
        self._arriving: dict[int, threading.Event] = {}
        """Set once no piece of a transfer under way can write its pages any more; guarded by _lock."""
        self._results: list[TransferResult] = []
        # Guards _expected, _dropped, _writes, _arriving, _results and queuing page writes.
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = threading.Event()
        self.timeline: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=4096)
        """(transfer id, header seen, every receive of its pages posted) in time.monotonic(), for the last
        transfers received: where D's time goes before the pages move (benchmarks/kv_transfer.py)."""

    def advise(self, dest_pages: list[int], what: str = "transfer") -> tuple[int, ...]:
        """The cuts `expect` returns for a transfer into `dest_pages`, registering nothing (the same for every
        receiver over a cache of this shape: a decode worker of several ranks advises for its ranks)."""
        return self._advise(dest_pages, what)[0]

    def _advise(self, dest_pages: list[int], what: str) -> tuple[tuple[int, ...], list[int] | None]:
        breaks = run_breaks(dest_pages) if self.in_place else None
        check_pages(dest_pages, self.cache.shape[0], what, breaks)
        size = len(dest_pages) * self.cache[0].numel() * self.cache.element_size()
        few = breaks and len(breaks) < self.config.max_receiver_runs
        return (tuple(breaks) if few and size > self.config.pipeline_min_bytes else ()), breaks

    def expect(self, transfer: ExpectedTransfer) -> tuple[int, ...]:
        """Returns, when the pages form 2 .. `max_receiver_runs` runs and the transfer is over
        `pipeline_min_bytes`, where they break runs: P cuts the transfer there (see `DistKVSender.send`). Below
        that size unpacking a copy costs less than a message per run."""
        # Where its pages break runs, worked out now rather than once its header is in.
        cuts, breaks = self._advise(transfer.dest_pages, f"transfer {transfer.transfer_id}")
        with self._lock:
            self._expected[transfer.transfer_id] = transfer
            self._breaks[transfer.transfer_id] = breaks
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
        return cuts

    def cancel(self, transfer_id: int) -> None:
        with self._lock:
            self._drop(transfer_id)
            write = self._writes.pop(transfer_id, None)
            arriving = self._arriving.get(transfer_id)
        if write is not None:
            write.synchronize()  # pieces that had arrived: no write is queued after this
        if arriving is not None and not arriving.wait(_CANCEL_GRACE_S + 10 * CHECK_S + 5.0):
            logger.error(
                "transfer %d: pieces may still arrive in its pages after its cancel", transfer_id
            )

    def poll(self) -> list[TransferResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        self._closed.set()
        for peer in self._peers.values():
            peer.pair.gone = True  # a thread waiting for its peer to join the link stops waiting
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
                    self._breaks.pop(transfer_id, None)
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

    def _post_header(self, pair: Pair) -> _Header:
        """Posts the receive of the next header (into the pair's scratch buffer: a pair carries one transfer
        at a time, and a header is read before the next one's receive is posted)."""
        scratch = pair.scratch()
        op = pair.recv(scratch.header, TAG_HEADER)
        if pair.stream is None:
            return _Header(op, scratch.header, None)
        op.wait()  # our side stream follows the receive (NCCL: no host wait)
        scratch.host.copy_(scratch.header, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _Header(op, scratch.host, copied)

    def _serve_peer(self, peer: str, pair: Pair, wake: threading.Event) -> None:
        header: _Header | None = None
        idle_reason = f"no KV pages from {peer} before the deadline"
        while not self._closed.is_set():
            try:
                if header is None:
                    # A header receive is posted only while a transfer from the peer is expected: a posted
                    # NCCL receive holds D's device until its message comes (see _RETIRE_UNEXPECTED_S).
                    if not self._expecting_from(peer):
                        wake.wait(IDLE_POLL_S * 25)
                        wake.clear()
                        continue
                    if pair.group is None:
                        pair.connect()
                    try:
                        header = self._post_header(pair)
                    except RuntimeError as e:
                        # The link closed while idle (gloo reports it at once). If the peer moved on, rebuild:
                        # no expected transfer is lost.
                        if pair.epoch_moved():
                            pair.drop()
                            continue
                        raise TransferError(f"KV link from {peer} closed: {e}") from e
                outcome = self._wait_header(peer, pair, header.op, idle_reason)
                if outcome is not _Wait.HEADER:
                    if outcome is _Wait.STALE:
                        # Retire the link, which withdraws the posted receive (and, past the group's timeout,
                        # NCCL's watchdog would take the whole process down). P re-reads the epoch on its next
                        # send and rebuilds the link with us.
                        pair.fail()
                    elif not self._closed.is_set():
                        pair.drop()  # the peer moved to a new epoch; rebuild on the next pass
                    header = None
                    continue
                pair.settled()  # a header came: both sides are past the group's rendezvous
                header = self._receive_one(peer, pair, header)
            except PeerAbsent as e:
                if self._closed.is_set():
                    break
                # It never joined: every transfer expected from it fails now.
                logger.warning("%s", e)
                header = None
                self._fail_all(peer, str(e))
            except TransferError as e:
                logger.warning("KV link from %s failed: %s", peer, e)
                header = None
                pair.fail()
                self._fail_overdue(peer, str(e))
            except Exception as e:  # thread boundary: report, rebuild the link, keep serving
                logger.error("KV receiver for %s crashed", peer, exc_info=True)
                header = None
                pair.fail()
                sync(pair.stream)
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

    def _receive_one(self, peer: str, pair: Pair, posted: _Header) -> _Header | None:
        """Receives the transfer whose header arrived; returns the next header's posted receive (None when no
        other transfer from the peer is expected)."""
        seen_at = time.monotonic()
        header = posted.fields()
        magic, transfer_id, num_pages, num_tokens, first_token = header[:5]
        layers, page_size, dim, itemsize, largest, first, metadata_len = header[5:]
        cut_at_runs = largest == CUT_AT_RECEIVER_RUNS
        sizes = (num_pages, layers, page_size, dim, first) + (() if cut_at_runs else (largest,))
        what = f"KV transfer {transfer_id} from {peer}"
        if magic == MAGIC and itemsize != self.cache.element_size() and min(sizes) > 0:
            error = (
                f"{what}: pages of {itemsize}-byte values, this cache holds "
                f"{self.cache.element_size()}-byte values (prefill and decode workers must share "
                f"kv_cache_dtype)"
            )
            with self._lock:
                if self._expected.pop(transfer_id, None) is not None:
                    self._results.append(TransferResult(transfer_id, error=error))
            raise TransferError(error)
        if magic != MAGIC or min(sizes) <= 0 or not 0 <= metadata_len <= MAX_METADATA_BYTES:
            raise TransferError(f"garbled or incompatible header from {peer}: {header}")
        self._await_expectation(transfer_id)
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:  # it came: no receive is kept posted for it any more
            self._dropped.pop(transfer_id, None)
            breaks = self._breaks.pop(transfer_id, None)
            if not cut_at_runs:
                plan = chunk_plan(num_pages, largest, first)
            elif breaks and len(breaks) + 1 == first and breaks[-1] < num_pages:
                plan = pieces_at(breaks, num_pages)
            else:  # the pieces' sizes are unknown here: the link cannot be kept
                error = f"{what}: cut into {first} pieces at runs of ours, which break at {breaks}"
                if self._expected.pop(transfer_id, None) is not None:
                    self._results.append(TransferResult(transfer_id, error=error))
                raise TransferError(error)
            dest = self._destination(transfer_id, num_pages, (layers, page_size, dim), what)
            if dest is None:
                breaks = None
            in_place = [breaks is not None and in_run(breaks, a, b) for a, b in plan]
            # From here on, a cancel waits until no piece can write in place any more.
            if any(in_place):
                self._arriving[transfer_id] = threading.Event()
        # The metadata comes first (P sends it right after the header); received even when discarded.
        scratch = pair.scratch()
        metadata_op = None
        if metadata_len:
            metadata_op = pair.recv(scratch.metadata_in(metadata_len), TAG_METADATA)
        ops, staged = [], []
        for (a, b), here in zip(plan, in_place, strict=True):
            if here:
                buffer = run_view(self.cache, dest[a], b - a)  # in place
            else:
                buffer = torch.empty(
                    (b - a, layers, page_size, dim), dtype=self.cache.dtype, device=self.device
                )
                staged.append((len(ops), a, b, buffer))
            ops.append(pair.recv(buffer, TAG_PAGES))
        self.timeline.append((transfer_id, seen_at, time.monotonic()))
        # While the pieces travel: the page ids to unpack into and both possible acks, so that little is left
        # to do after the last piece.
        dest_dev = device_ids(dest, self.device) if dest is not None and staged else None
        acks = device_ids([transfer_id, ACK_OK, transfer_id, ACK_DISCARDED], self.device).view(2, 2)
        ok = dest is not None
        metadata = b""
        try:
            give_up = self._give_up_check(transfer_id) if any(in_place) else None
            if metadata_op is not None:  # read while the pages travel
                self._wait_pieces(metadata_op, deadline, what, give_up)
                metadata = scratch.metadata_read(metadata_len)
            for i, a, b, buffer in staged:
                # After this wait our (side) stream follows the piece's receive.
                self._wait_pieces(ops[i], deadline, what, give_up)
                if ok:
                    ok = self._write_piece(transfer_id, dest_dev[a:b], buffer)
            self._wait_pieces(ops[-1], deadline, what, give_up)
        except TransferError as e:
            # Tear the link down before anyone may free the pages: that stops pieces still arriving in place.
            pair.drop()
            sync(pair.stream)
            with self._lock:
                self._writes.pop(transfer_id, None)
                if self._expected.pop(transfer_id, None) is not None:
                    self._results.append(TransferResult(transfer_id, error=str(e)))
            raise
        finally:
            with self._lock:
                arriving = self._arriving.pop(transfer_id, None)
            if arriving is not None:
                arriving.set()
        # Report first (the decode worker waits on it), then acknowledge; then, if another transfer from the peer
        # is expected, post the next header's receive, so that a transfer queued behind this one on P finds it.
        with self._lock:
            write = self._writes.pop(transfer_id, None)
            if write is not None:
                write.synchronize()
            ok = ok and self._expected.pop(transfer_id, None) is not None
            if ok:
                self._results.append(
                    TransferResult(
                        transfer_id,
                        num_tokens,
                        first_token,
                        completed_at=time.monotonic(),
                        started_at=seen_at,
                        metadata=metadata,
                    )
                )
        ack_op = pair.send(acks[0 if ok else 1], TAG_ACK)
        next_header = None
        if self._expecting_from(peer, besides=transfer_id):
            next_header = self._post_header(pair)
        wait_ops([ack_op], deadline, f"ack of {what}", self.config.spin_s)
        return next_header

    def _await_expectation(self, transfer_id: int) -> None:
        """Waits up to `expect_grace_s` for a transfer whose header came before its `expect` (neither expected
        nor dropped here yet): a rank of a decode worker of several ranks is told what to expect with its
        worker's next step, possibly after the prefill worker sent. Past the grace it is received and
        discarded."""
        until = time.monotonic() + self.config.expect_grace_s
        while True:
            with self._lock:
                if transfer_id in self._expected or transfer_id in self._dropped:
                    return
            if time.monotonic() >= until or self._closed.is_set():
                return
            time.sleep(IDLE_POLL_S / 10)

    def _give_up_check(self, transfer_id: int):
        """For waits on a transfer arriving in place: True once it has been cancelled for `_CANCEL_GRACE_S`."""
        cancelled_at = None

        def check() -> bool:
            nonlocal cancelled_at
            with self._lock:
                if transfer_id in self._expected:
                    return False
            now = time.monotonic()
            cancelled_at = cancelled_at or now
            return now - cancelled_at >= _CANCEL_GRACE_S

        return check

    def _wait_pieces(self, op: Op, deadline: float, what: str, give_up) -> None:
        if not wait_ops([op], deadline, what, self.config.spin_s, check=give_up):
            raise TransferError(
                f"{what} was cancelled while its pages arrived in place, and they stopped coming for "
                f"{_CANCEL_GRACE_S:g}s; the link is rebuilt"
            )

    def _destination(
        self, transfer_id: int, num_pages: int, layout: tuple[int, int, int], what: str
    ) -> list[int] | None:
        """(Under _lock.) The page ids to write the transfer into; None to discard it (not expected, or not
        fitting: then it is reported failed). Either way the pieces are received, so the pair stays usable."""
        expected = self._expected.get(transfer_id)
        if expected is None:
            return None
        cache_layout = tuple(self.cache.shape[1:])
        error = None
        if len(expected.dest_pages) != num_pages:
            error = f"{what}: {num_pages} pages for {len(expected.dest_pages)} reserved"
        elif layout != cache_layout:
            error = f"{what}: pages of layout {layout}, the cache's is {cache_layout}"
        if error is not None:
            del self._expected[transfer_id]
            self._results.append(TransferResult(transfer_id, error=error))
            return None
        return list(expected.dest_pages)

    def _write_piece(self, transfer_id: int, dest: torch.Tensor, packed: torch.Tensor) -> bool:
        """Queues the unpacking of a packed piece into pages `dest`, unless the transfer was cancelled or failed
        meanwhile; returns whether it is still expected."""
        with self._lock:
            if transfer_id not in self._expected:
                return False
            scatter_pages(self.cache, dest, packed)
            if self.device.type == "cuda":
                write = torch.cuda.Event()
                write.record()
                self._writes[transfer_id] = write
        return True
