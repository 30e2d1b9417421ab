"""The KV transfer contract between a prefill worker (P) and a decode worker (D).

Ownership. D owns its cache: before P sends, D reserves destination pages for the request and registers them with
`KVReceiver.expect`; the receiver writes into D's cache at those pages and nowhere else. P owns its source pages
until `KVSender.send` returns (acknowledged or failed); then P frees them, either way. D frees the destination
pages itself if the transfer fails or the request is cancelled.

Ordering. Transfers between one (P, D) pair travel in the order P sends them; different pairs are independent. A
transfer is a header (the request's transfer id, page count, token count and first sampled token), then P's metadata
for the request (opaque bytes, possibly none: what P knows of the request beyond its KV, which D needs with its
first token), then the pages, whole pages [num_pages, num_layers, page_size, entry_dim] in the request's page order
(possibly cut into pieces along the page axis), never per-token messages. The metadata reaches D with the pages,
never apart: `TransferResult.metadata` of the transfer that put them in the cache. Caches are page-major, so a run
of consecutive pages is sent from, and received into, the cache in place.

Acknowledgement. D acknowledges a transfer after its pages are in D's cache (device writes included); `send`
returns only then, and D reports the transfer through `poll` only then. A transfer D no longer expects (cancelled,
timed out) is still received, then discarded and acknowledged, so the pair stays usable.

Timeouts. Every wait has one. `send` raises `TransferError` after `timeout_s`; D reports a transfer that has not
arrived by its deadline as failed (`TransferResult.error`). A pair whose link broke is rebuilt on next use; only
the requests in flight on it fail.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import torch

MAX_METADATA_BYTES = 1 << 20
"""The most metadata one transfer carries (a header announcing more is garbled): it is a request's small extras,
never bulk data."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExpectedTransfer:
    transfer_id: int
    """Unique on the decode worker; P echoes it in the header."""
    peer: str
    """Worker id of the prefill worker that will send it."""
    dest_pages: list[int]
    deadline: float
    """time.monotonic() by which the pages must have arrived."""


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    transfer_id: int
    num_tokens: int = 0
    """Tokens whose KV arrived (the prompt, plus any earlier output when recomputing)."""
    first_token: int = -1
    """The token P sampled after those tokens."""
    error: str | None = None
    """None when the pages are in the cache; otherwise what went wrong."""
    completed_at: float | None = None
    """time.monotonic() when the pages were in the cache (None on failure, or where the receiver does not say)."""
    started_at: float | None = None
    """time.monotonic() on the same clock as `completed_at` when the transfer's header arrived (None as there)."""
    metadata: bytes = b""
    """The bytes P passed to `send` with these pages, unchanged (empty on failure)."""


class KVSender(abc.ABC):
    """Prefill side. Thread-safe: sends to different peers may run concurrently."""

    @abc.abstractmethod
    def send(
        self, peer: str, transfer_id: int, cache: torch.Tensor, page_ids: list[int],
        num_tokens: int, first_token: int, dest_cuts: Sequence[int] = (), metadata: bytes = b"",
    ) -> None:  # fmt: skip
        """Sends pages `page_ids` (all layers, in that order) of the page-major `cache` [num_pages, num_layers,
        page_size, dim] to decode worker `peer`; blocks until it acknowledged. The pages' device writes must have
        completed when `send` is called; they are read until it returns. `dest_cuts`: what the receiver's
        `expect` returned for this transfer, passed on unchanged (an implementation may ignore it). `metadata`:
        bytes that reach D with the pages (`TransferResult.metadata`), at most `MAX_METADATA_BYTES`. Raises
        TransferError (naming the peer and what happened) on failure or timeout, and for metadata over the
        bound."""

    def connect(self, peer: str) -> None:  # noqa: B027 (optional hook)
        """Starts building the link to `peer` in the background, so that it is up by the time a transfer is ready.
        Called when a request for `peer` arrives; the decode side reads a peer that never joins as dead."""

    def forget(self, peer: str) -> None:  # noqa: B027 (optional hook)
        """Decode worker `peer` (and each of its ranks' endpoints, `peer.rN`) is gone for good: sends to it, waiting
        for its link or to come, fail at once instead of after connect_timeout_s."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases the channels."""


class KVReceiver(abc.ABC):
    """Decode side. `expect`/`cancel` may be called from any thread; `poll` from the worker's loop."""

    @abc.abstractmethod
    def expect(self, transfer: ExpectedTransfer) -> tuple[int, ...]:
        """Registers a transfer to receive into `dest_pages`. Returns advice for the sender (its `dest_cuts`):
        indices into `dest_pages` where the sender should cut the pages into pieces, empty for none."""

    @abc.abstractmethod
    def cancel(self, transfer_id: int) -> None:
        """Stops expecting a transfer. After this returns its pages are never written; the caller may free them."""

    @abc.abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that completed or failed since the last call (each reported once)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases the channels."""


MakeReceiver = Callable[[torch.Tensor], KVReceiver]
"""Decode side: builds the worker's receiver over its page-major cache [num_pages, num_layers, page_size,
entry_dim]."""
