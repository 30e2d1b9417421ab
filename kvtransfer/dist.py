"""The KV transfer over torch.distributed: one two-rank process group per (P, D) pair, P is rank 0, D is rank 1.

Groups are built lazily from a shared TCPStore through a PrefixStore, never the default group, so pools grow and
shrink without touching other pairs. Each pair has an epoch counter in the store: whichever side sees the link
fail aborts its group and bumps the epoch, and both sides rebuild under the new epoch's prefix on next use. Before
building, the two sides meet in the store (each sets a ready key and waits, with a timeout, for the other's), so a
dead peer costs a timeout, never a hang. Operations are posted asynchronously and polled against a deadline.

Wire format per transfer, in order: header int64[8] P->D, pages P->D, ack int64[2] D->P.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.model.errors import TransferError

from .base import ExpectedTransfer, KVReceiver, KVSender, TransferResult, WritePages
from .config import KVTransferConfig

logger = logging.getLogger(__name__)

_MAGIC = 0x4B565846  # "KVXF"
_HEADER_LEN = 8
_ACK_OK, _ACK_DISCARDED = 1, 2
_POLL_S = 0.00002
_IDLE_POLL_S = 0.002
_FAST_POLL_WINDOW_S = 0.02
_CHECK_S = 0.05
_SENDER_EPOCH_TTL_S = 1.0
"""How long the prefill side trusts its last read of a pair's epoch (a store round trip per send would cost
~0.2 ms); a failed send re-reads it."""


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


class _PeerAbsent(TransferError):
    """The other side of a pair did not join in time: presumed dead."""


class _Pair:
    """One side of the process group of a (P, D) pair. Not thread-safe: each user holds `lock`."""

    def __init__(self, store, prefill_id: str, decode_id: str, rank: int, backend: str, config):
        self.store, self.rank, self.backend, self.config = store, rank, backend, config
        self.key = f"pdkv/{prefill_id}/{decode_id}"
        self.peer = decode_id if rank == 0 else prefill_id
        self.lock = threading.Lock()
        self.group: dist.ProcessGroup | None = None
        self.epoch = -1
        self._epoch_read_at = -float("inf")

    def current_epoch(self) -> int:
        self._epoch_read_at = time.monotonic()
        return int(self.store.add(f"{self.key}/epoch", 0))

    def connect(self, epoch_ttl_s: float = 0.0) -> dist.ProcessGroup:
        """The pair's group for the current epoch, building it (meeting the peer) when needed. With
        `epoch_ttl_s`, an epoch read that recently is trusted without asking the store."""
        fresh = time.monotonic() - self._epoch_read_at < epoch_ttl_s
        if self.group is not None and fresh:
            return self.group
        epoch = self.current_epoch()
        if self.group is not None and epoch == self.epoch:
            return self.group
        self.drop()
        prefix = f"{self.key}/{epoch}"
        self.store.set(f"{prefix}/ready{self.rank}", "1")
        try:
            self.store.wait(
                [f"{prefix}/ready{1 - self.rank}"], timedelta(seconds=self.config.connect_timeout_s)
            )
        except Exception as e:  # the store raises on timeout
            raise _PeerAbsent(
                f"{self.peer} did not join the KV link within {self.config.connect_timeout_s:g}s"
            ) from e
        prefixed = dist.PrefixStore(prefix, self.store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.config.idle_timeout_s)
            self.group = dist.ProcessGroupNCCL(prefixed, self.rank, 2, options)
        else:
            timeout = timedelta(seconds=self.config.idle_timeout_s)
            self.group = dist.ProcessGroupGloo(prefixed, self.rank, 2, timeout)
        self.epoch = epoch
        return self.group

    def send(self, tensor: torch.Tensor, tag: int) -> _Op:
        return _Op(self.group.send([tensor], 1 - self.rank, tag), self.group, self.backend)

    def recv(self, tensor: torch.Tensor, tag: int) -> _Op:
        return _Op(self.group.recv([tensor], 1 - self.rank, tag), self.group, self.backend)

    def drop(self) -> None:
        if self.group is not None and self.backend == "nccl":
            try:
                self.group.abort()
            except Exception:  # already broken: nothing more to release
                logger.debug("abort of %s failed", self.key, exc_info=True)
        self.group = None

    def fail(self) -> None:
        """The link is unusable: drop our side and move both sides to a new epoch."""
        self.drop()
        self._epoch_read_at = -float("inf")
        self.store.add(f"{self.key}/epoch", 1)


class _Op:
    """A posted send or receive that can be polled. NCCL works report completion themselves; a gloo work only
    completes inside `wait()` (and a timed-out wait closes the pair), so a helper thread waits on it."""

    def __init__(self, work, group: dist.ProcessGroup, backend: str):
        self.work, self.error = work, None
        self._done: threading.Event | None = None
        if backend == "gloo":
            self._done = threading.Event()
            # The thread holds the group: it stays alive until the wait ends, even if abandoned.
            threading.Thread(target=self._wait_gloo, args=(group,), daemon=True).start()

    def _wait_gloo(self, group: dist.ProcessGroup) -> None:
        try:
            self.work.wait()
        except Exception as e:  # reported by wait()
            self.error = e
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set() if self._done is not None else self.work.is_completed()

    def wait(self) -> None:
        if self._done is None:
            self.work.wait()
        elif self.error is not None:
            raise self.error


def _wait(
    works: list[_Op], deadline: float, what: str, check: Callable[[], bool] | None = None
) -> bool:
    """Polls `works` until all complete; raises TransferError at `deadline` or on a failed op. Every
    `_CHECK_S`, `check()` may return True to give up waiting (the call then returns False)."""
    start = time.monotonic()
    next_check = start + _CHECK_S
    while not all(w.is_completed() for w in works):
        now = time.monotonic()
        if now > deadline:
            raise TransferError(f"{what} timed out")
        if check is not None and now >= next_check:
            if check():
                return False
            next_check = now + _CHECK_S
        time.sleep(_POLL_S if now - start < _FAST_POLL_WINDOW_S else _IDLE_POLL_S)
    for w in works:
        try:
            w.wait()
        except Exception as e:
            raise TransferError(f"{what} failed: {e}") from e
    return True


class DistKVSender(KVSender):
    """Prefill side: a group per decode peer, one transfer at a time per peer."""

    delay_after_header_s: float = 0.0
    """Fault injection for tests: stall this long between the header and the pages."""

    def __init__(self, config: KVTransferConfig, store, worker_id: str, device: torch.device):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.device, self.backend = torch.device(device), _backend(config, torch.device(device))
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()

    def _pair(self, peer: str) -> _Pair:
        with self._lock:
            if peer not in self._pairs:
                self._pairs[peer] = _Pair(
                    self.store, self.worker_id, peer, 0, self.backend, self.config
                )
            return self._pairs[peer]

    def connect(self, peer: str) -> None:
        pair = self._pair(peer)

        def build() -> None:
            with pair.lock:
                try:
                    pair.connect()
                except TransferError as e:
                    logger.warning("%s", e)

        threading.Thread(target=build, daemon=True, name=f"kv-connect-{peer}").start()

    def send(
        self, peer: str, transfer_id: int, pages: torch.Tensor, num_tokens: int, first_token: int
    ) -> None:
        pair = self._pair(peer)
        what = f"KV transfer {transfer_id} ({pages.numel() * pages.element_size()} bytes) to {peer}"
        with pair.lock:
            pair.connect(epoch_ttl_s=_SENDER_EPOCH_TTL_S)
            deadline = time.monotonic() + self.config.timeout_s
            layers, num_pages, page_size, dim = pages.shape
            fields = [
                _MAGIC,
                transfer_id,
                num_pages,
                num_tokens,
                first_token,
                layers,
                page_size,
                dim,
            ]
            header = torch.tensor(fields, dtype=torch.int64).to(self.device)
            ack = torch.zeros(2, dtype=torch.int64, device=self.device)
            try:
                works = [pair.send(header, 0)]
                if self.delay_after_header_s:
                    _wait(works, deadline, what)
                    time.sleep(self.delay_after_header_s)
                works += [pair.send(pages.contiguous(), 1), pair.recv(ack, 2)]
                _wait(works, deadline, what)
            except TransferError:
                pair.fail()
                raise
            except Exception as e:
                pair.fail()
                raise TransferError(f"{what} failed: {e}") from e
        ack_id, status = ack.tolist()
        if ack_id != transfer_id or status not in (_ACK_OK, _ACK_DISCARDED):
            raise TransferError(f"{what}: bad acknowledgement {ack.tolist()}")

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.drop()
            self._pairs.clear()


@dataclasses.dataclass
class _Peer:
    pair: _Pair
    thread: threading.Thread


class DistKVReceiver(KVReceiver):
    """Decode side: a receiving thread per prefill peer, started when the first transfer from it is expected."""

    def __init__(
        self,
        config: KVTransferConfig,
        store,
        worker_id: str,
        device: torch.device,
        write_pages: WritePages,
        dtype: torch.dtype,
    ):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.device, self.backend = torch.device(device), _backend(config, torch.device(device))
        self.write_pages, self.dtype = write_pages, dtype
        self._expected: dict[int, ExpectedTransfer] = {}
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()  # guards _expected, _results and every page write
        self._peers: dict[str, _Peer] = {}
        self._closed = threading.Event()

    def expect(self, transfer: ExpectedTransfer) -> None:
        with self._lock:
            self._expected[transfer.transfer_id] = transfer
            if transfer.peer not in self._peers:
                pair = _Pair(
                    self.store, transfer.peer, self.worker_id, 1, self.backend, self.config
                )
                thread = threading.Thread(
                    target=self._receive_loop, args=(transfer.peer, pair), daemon=True,
                    name=f"kv-recv-{transfer.peer}",
                )  # fmt: skip
                self._peers[transfer.peer] = _Peer(pair, thread)
                thread.start()

    def cancel(self, transfer_id: int) -> None:
        with self._lock:  # waits for a page write in progress
            self._expected.pop(transfer_id, None)

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

    def _expecting_from(self, peer: str) -> list[ExpectedTransfer]:
        with self._lock:
            return [t for t in self._expected.values() if t.peer == peer]

    def _fail_expected(self, peer: str, reason: str, overdue_only: bool) -> None:
        """Reports as failed the transfers expected from `peer` (only those past their deadline, if asked)."""
        now = time.monotonic()
        with self._lock:
            for t in [t for t in self._expected.values() if t.peer == peer]:
                if overdue_only and t.deadline >= now:
                    continue
                del self._expected[t.transfer_id]
                self._results.append(TransferResult(t.transfer_id, error=reason))

    def _fail_overdue(self, peer: str, reason: str) -> None:
        self._fail_expected(peer, reason, overdue_only=True)

    def _fail_all(self, peer: str, reason: str) -> None:
        self._fail_expected(peer, reason, overdue_only=False)

    def _receive_loop(self, peer: str, pair: _Pair) -> None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        header_work = None
        idle_reason = f"no KV pages from {peer} before the deadline"

        def give_up() -> bool:
            self._fail_overdue(peer, idle_reason)
            return self._closed.is_set() or self._epoch_moved(pair)

        while not self._closed.is_set():
            try:
                if header_work is None:
                    if not self._expecting_from(peer):
                        time.sleep(0.01)
                        continue
                    pair.connect()
                    header_work = pair.recv(header, 0)
                got = _wait([header_work], float("inf"), f"header from {peer}", give_up)
                if not got:
                    if not self._closed.is_set():
                        pair.drop()  # the peer moved to a new epoch; rebuild on the next pass
                    header_work = None
                    continue
                header_work = None
                self._receive_one(peer, pair, header.tolist())
            except _PeerAbsent as e:
                # It never joined: every transfer expected from it fails now.
                logger.warning("%s", e)
                header_work = None
                self._fail_all(peer, str(e))
            except TransferError as e:
                logger.warning("KV link from %s failed: %s", peer, e)
                header_work = None
                pair.fail()
                self._fail_overdue(peer, str(e))
            except Exception as e:  # thread boundary: report, rebuild the link, keep serving
                logger.error("KV receiver for %s crashed", peer, exc_info=True)
                header_work = None
                pair.fail()
                self._fail_all(peer, f"KV receiver error: {e}")

    def _epoch_moved(self, pair: _Pair) -> bool:
        return pair.current_epoch() != pair.epoch

    def _receive_one(self, peer: str, pair: _Pair, header: list[int]) -> None:
        magic, transfer_id, num_pages, num_tokens, first_token, layers, page_size, dim = header
        if magic != _MAGIC:
            raise TransferError(f"garbled header from {peer}: {header}")
        staging = torch.empty(
            (layers, num_pages, page_size, dim), dtype=self.dtype, device=self.device
        )
        deadline = time.monotonic() + self.config.timeout_s
        what = f"KV transfer {transfer_id} from {peer}"
        try:
            _wait([pair.recv(staging, 1)], deadline, what)
        except TransferError as e:
            with self._lock:
                if self._expected.pop(transfer_id, None) is not None:
                    self._results.append(TransferResult(transfer_id, error=str(e)))
            raise
        with self._lock:
            expected = self._expected.pop(transfer_id, None)
            if expected is not None:
                if len(expected.dest_pages) != num_pages:
                    self._results.append(TransferResult(
                        transfer_id, error=f"{what}: {num_pages} pages for {len(expected.dest_pages)} reserved"
                    ))  # fmt: skip
                    expected = None
                else:
                    self.write_pages(expected.dest_pages, staging)
                    self._results.append(TransferResult(transfer_id, num_tokens, first_token))
        status = _ACK_OK if expected is not None else _ACK_DISCARDED
        ack = torch.tensor([transfer_id, status], dtype=torch.int64).to(self.device)
        _wait([pair.send(ack, 2)], deadline, f"ack of {what}")
