"""The KV transfer over torch.distributed: one two-rank process group per (P, D) pair (see `_link`), NCCL for CUDA
caches, gloo for CPU ones.

Wire format: see `_wire`. The decode side lives in `_receiver` (re-exported here).

In place. The caches are page-major, so a run of consecutive pages is one contiguous block. P sends a piece whose
pages are a run straight from its cache, and D receives a piece whose pages are a run straight into its cache:
a request whose pages are one run on both sides (what the allocators hand out while they can) travels as one
message with no copy, as fast as a bare send of its bytes. When D's pages are a few runs (a fuller decode pool),
D's `expect` returns where they break; that advice reaches P through the router (`dest_cuts`), and a P whose
pages are one run sends one piece per run of D's, each landing in place.

Metadata. P's bytes for the request (`send`'s `metadata`) follow the header as one small message, before the
pages, and D hands them back with the transfer's result; neither side reads them.

Pipelining, for pages that are not in a run. P posts the header (and the metadata) first, then packs piece i on a
side stream and posts its send; NCCL runs the sends in order, so the packing of piece i + 1 overlaps the send of
piece i. D posts the receives of all pieces as soon as the header is in, and unpacks each packed piece into its
cache pages while the next is on the wire. D decides each unpacking on the host, after the piece arrived and under
the receiver's lock, so a `cancel` stops all further writes at once; it then waits for the writes already queued.

A cancel while pieces are arriving in place waits for them (normally a millisecond); if P stalls mid-transfer,
D gives up after `_CANCEL_GRACE_S` and tears down the link, which stops the writes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.model.errors import TransferError

from ._link import SENDER_EPOCH_TTL_S, Pair, backend_for, sync, wait_ops
from ._receiver import DistKVReceiver
from ._wire import (
    ACK_DISCARDED,
    ACK_OK,
    CUT_AT_RECEIVER_RUNS,
    HEADER_LEN,
    MAGIC,
    TAG_ACK,
    TAG_HEADER,
    TAG_METADATA,
    TAG_PAGES,
    chunk_plan,
    pieces_at,
)
from .base import MAX_METADATA_BYTES, KVSender
from .config import KVTransferConfig
from .pages import check_pages, device_ids, gather_pages, in_run, run_breaks, run_view
from .store import connect_store

__all__ = ["DistKVReceiver", "DistKVSender", "SendProfile", "chunk_plan", "connect_store"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SendProfile:
    """Where the time of the last successful `send` to a peer went (host clock, seconds from entering `send`)."""

    started_at: float
    """time.monotonic() on entering `send` (the same clock as `TransferResult.completed_at` on D's host)."""
    header_s: float
    """The header's send (and the metadata's) posted."""
    posted_s: float
    """Every piece gathered (queued) and every operation posted."""
    done_s: float
    """The acknowledgement read."""
    num_pieces: int


def _checked_cuts(cuts: Sequence[int], n: int, what: str) -> list[int]:
    cuts = list(cuts)
    if any(not 0 < b < n for b in cuts) or any(
        a >= b for a, b in zip(cuts, cuts[1:], strict=False)
    ):
        raise TransferError(
            f"{what}: the receiver's cuts {cuts} are not increasing inside (0, {n})"
        )
    return cuts


class DistKVSender(KVSender):
    """Prefill side: a group per decode peer, one transfer at a time per peer."""

    delay_after_header_s: float = 0.0
    """Fault injection for tests: stall this long between the header and the pages."""

    def __init__(self, config: KVTransferConfig, store, worker_id: str, device: torch.device):
        self.config, self.store, self.worker_id = config, store, worker_id
        self.device, self.backend = torch.device(device), backend_for(config, torch.device(device))
        self.in_place = self.backend == "nccl"
        """Send runs of pages straight from the cache. Only where a failed link can be torn down under a posted
        send (NCCL's abort; gloo cannot withdraw one), so that no send reads pages after `send` returned."""
        self._pairs: dict[str, Pair] = {}
        self._gone: set[str] = set()
        """Decode workers forgotten (`forget`): their endpoints' pairs are born gone."""
        self._lock = threading.Lock()
        self.last_profile: dict[str, SendProfile] = {}

    def _pair(self, peer: str) -> Pair:
        with self._lock:
            return self._pair_locked(peer)

    def _pair_locked(self, peer: str) -> Pair:
        if peer not in self._pairs:
            self._pairs[peer] = Pair(
                self.store, self.worker_id, peer, 0, self.backend, self.config, self.device
            )
            self._pairs[peer].gone = self._is_gone(peer)
        return self._pairs[peer]

    def connect(self, peer: str) -> None:
        pair = self._pair(peer)

        def build() -> None:
            try:
                with pair.held(), pair.on_device():
                    pair.connect()
            except TransferError as e:
                logger.warning("%s", e)

        threading.Thread(target=build, daemon=True, name=f"kv-connect-{peer}").start()

    def send(
        self, peer: str, transfer_id: int, cache: torch.Tensor, page_ids: list[int],
        num_tokens: int, first_token: int, dest_cuts: Sequence[int] = (), metadata: bytes = b"",
    ) -> None:  # fmt: skip
        start = time.monotonic()
        pair = self._pair(peer)
        num_cache_pages, num_layers, page_size, dim = cache.shape
        page_bytes = num_layers * page_size * dim * cache.element_size()
        n = len(page_ids)
        what = f"KV transfer {transfer_id} ({n * page_bytes} bytes) to {peer}"
        if len(metadata) > MAX_METADATA_BYTES:
            raise TransferError(
                f"{what}: {len(metadata)} bytes of metadata, more than the {MAX_METADATA_BYTES} allowed"
            )
        breaks = run_breaks(page_ids) if self.in_place else None
        check_pages(page_ids, num_cache_pages, what, breaks)
        # A run here, a few there: a piece per run of D's pages, all in place.
        if breaks == [] and dest_cuts:
            plan = pieces_at(_checked_cuts(dest_cuts, n, what), n)
            largest, first = CUT_AT_RECEIVER_RUNS, len(plan)
        else:
            if breaks == [] or n * page_bytes <= self.config.pipeline_min_bytes:
                largest, first = n, n  # in place, or too small to gain from pieces: one piece
            else:
                largest = max(1, self.config.chunk_bytes // page_bytes)
                first = max(1, self.config.first_piece_bytes // page_bytes)
            plan = chunk_plan(n, largest, first)
        fields = [
            MAGIC, transfer_id, n, num_tokens, first_token,
            num_layers, page_size, dim, cache.element_size(), largest, first, len(metadata),
        ]  # fmt: skip
        with pair.held(), pair.on_device():
            pair.connect(epoch_ttl_s=SENDER_EPOCH_TTL_S)
            deadline = time.monotonic() + self.config.timeout_s
            try:
                # The header goes first: D learns the size from it, and posts its receives while we pack.
                scratch = pair.scratch()
                ack = scratch.ack
                if breaks == []:  # one run, nothing to pack: the header through the pinned buffer
                    scratch.host_np[:] = fields
                    header = scratch.header.copy_(scratch.host, non_blocking=True)
                    ids = None
                else:  # the header and the page ids to pack in one copy to the device
                    fields_dev = device_ids(fields + page_ids, self.device)
                    header, ids = fields_dev[:HEADER_LEN], fields_dev[HEADER_LEN:]
                ops = [pair.send(header, TAG_HEADER)]
                if metadata:
                    ops.append(pair.send(scratch.metadata_out(metadata), TAG_METADATA))
                header_at = time.monotonic()
                if self.delay_after_header_s:
                    wait_ops(ops, deadline, what, self.config.spin_s)
                    time.sleep(self.delay_after_header_s)
                pieces = []  # referenced until the sends complete
                for a, b in plan:
                    if breaks is not None and in_run(breaks, a, b):
                        pieces.append(run_view(cache, page_ids[a], b - a))  # [k, L, S, D], in place
                    else:
                        pieces.append(gather_pages(cache, ids[a:b]))
                    ops.append(pair.send(pieces[-1], TAG_PAGES))
                ops.append(pair.recv(ack, TAG_ACK))
                posted = time.monotonic()
                wait_ops(ops, deadline, what, self.config.spin_s)
                ack_id, status = ack.tolist()
                pair.settled()
            except Exception as e:
                pair.fail()
                sync(pair.stream)  # no gather may still read pages the caller frees on our return
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"{what} failed: {e}") from e
        if ack_id != transfer_id or status not in (ACK_OK, ACK_DISCARDED):
            raise TransferError(f"{what}: bad acknowledgement {[ack_id, status]}")
        now = time.monotonic()
        self.last_profile[peer] = SendProfile(
            start, header_at - start, posted - start, now - start, len(plan)
        )

    def forget(self, peer: str) -> None:
        with self._lock:
            self._gone.add(peer)
            for name, pair in self._pairs.items():
                pair.gone = pair.gone or self._is_gone(name)

    def _is_gone(self, peer: str) -> bool:
        return any(peer == g or peer.startswith(f"{g}.") for g in self._gone)

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.drop()
            self._pairs.clear()
