"""An in-process implementation of the KV transfer contract, for unit tests and single-process setups: a hub
connects senders to receivers by worker id and `send` writes straight into the receiver's cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from pdserve.model.errors import TransferError

from .base import MAX_METADATA_BYTES, ExpectedTransfer, KVReceiver, KVSender, TransferResult
from .pages import gather_pages, scatter_pages


class LoopbackHub:
    def __init__(self) -> None:
        self.receivers: dict[str, LoopbackReceiver] = {}


class LoopbackReceiver(KVReceiver):
    def __init__(self, hub: LoopbackHub, worker_id: str, cache: torch.Tensor):
        self.cache = cache
        self._expected: dict[int, ExpectedTransfer] = {}
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()
        hub.receivers[worker_id] = self

    def expect(self, transfer: ExpectedTransfer) -> tuple[int, ...]:
        with self._lock:
            self._expected[transfer.transfer_id] = transfer
        return ()

    def cancel(self, transfer_id: int) -> None:
        with self._lock:
            self._expected.pop(transfer_id, None)

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        with self._lock:
            for t in [t for t in self._expected.values() if t.deadline < now]:
                del self._expected[t.transfer_id]
                self._results.append(
                    TransferResult(
                        t.transfer_id, error=f"no KV pages from {t.peer} before the deadline"
                    )
                )
            results, self._results = self._results, []
        return results

    def deliver(
        self, transfer_id: int, pages: torch.Tensor, num_tokens: int, first_token: int,
        metadata: bytes = b"",
    ) -> None:  # fmt: skip
        started_at = time.monotonic()
        with self._lock:
            expected = self._expected.pop(transfer_id, None)
            if expected is None:
                return  # cancelled or timed out: discarded, still acknowledged
            if len(expected.dest_pages) != pages.shape[0]:
                # reported failed here (as the torch.distributed receiver does) and to the sender
                error = f"transfer {transfer_id}: {pages.shape[0]} pages for {len(expected.dest_pages)} reserved"
                self._results.append(TransferResult(transfer_id, error=error))
                raise TransferError(error)
            dest = torch.tensor(expected.dest_pages, dtype=torch.int64, device=self.cache.device)
            packed = pages.to(self.cache.device, self.cache.dtype).contiguous()
            scatter_pages(self.cache, dest, packed)
            if self.cache.is_cuda:
                torch.cuda.current_stream(self.cache.device).synchronize()
            self._results.append(
                TransferResult(
                    transfer_id,
                    num_tokens,
                    first_token,
                    completed_at=time.monotonic(),
                    started_at=started_at,
                    metadata=bytes(metadata),
                )
            )


class LoopbackSender(KVSender):
    def __init__(self, hub: LoopbackHub):
        self.hub = hub

    def send(
        self, peer: str, transfer_id: int, cache: torch.Tensor, page_ids: list[int],
        num_tokens: int, first_token: int, dest_cuts: Sequence[int] = (), metadata: bytes = b"",
    ) -> None:  # fmt: skip
        receiver = self.hub.receivers.get(peer)
        if receiver is None:
            raise TransferError(f"KV transfer {transfer_id}: no decode worker {peer!r}")
        if len(metadata) > MAX_METADATA_BYTES:
            raise TransferError(
                f"KV transfer {transfer_id}: {len(metadata)} bytes of metadata, more than the "
                f"{MAX_METADATA_BYTES} allowed"
            )
        ids = torch.tensor(page_ids, dtype=torch.int64, device=cache.device)
        pages = gather_pages(cache, ids)
        receiver.deliver(transfer_id, pages, num_tokens, first_token, metadata)
