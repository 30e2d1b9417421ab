"""KV transfers into a decode worker of several ranks, whose KV pages live in its ranks' processes.

Each data-parallel rank of such a worker receives its own requests' pages: rank r is the KV endpoint
`rank_endpoint(worker_id, r)`, a `KVReceiver` over that rank's cache, built in the rank's process
(`RankKVEndpoint`). The driver's scheduler decides which rank a request lives on; `RankKVControl` (the driver's
side) queues what each rank must expect or cancel and sends it with the worker's next step round, and the ranks
answer with the transfers that arrived. The router tells the prefill worker the request's endpoint, and a header
that reaches a rank before its expectation waits for it (`KVTransferConfig.expect_grace_s`).

A cancelled transfer's pages are freed only once its rank has cancelled it (no piece can write them any more):
`RankKVControl.cancel` keeps them until the round that carried the cancel has returned (`delivered`).

Wire (plain lists, carried in the step round beside the step plan): per rank `[expects, cancels]` with an expect
`[transfer_id, peer, dest_pages, timeout_s]` and a cancel `transfer_id`; a rank answers arrivals
`[transfer_id, num_tokens, first_token, error, started_at, completed_at, metadata]` (a `TransferResult`'s fields,
the prefill worker's metadata as bytes)."""

from __future__ import annotations

import time
from typing import Any

from pdserve.kvtransfer import ExpectedTransfer, TransferResult

__all__ = ["RankKVControl", "RankKVEndpoint", "rank_endpoint"]


def rank_endpoint(worker_id: str, rank: int) -> str:
    """The KV endpoint (the peer name a prefill worker sends to) of rank `rank` of decode worker `worker_id`."""
    return f"{worker_id}.r{rank}"


def arrival_to_wire(result: TransferResult) -> list:
    r = result
    return [
        r.transfer_id, r.num_tokens, r.first_token, r.error, r.started_at, r.completed_at, r.metadata,
    ]  # fmt: skip


def arrival_from_wire(wire: list) -> TransferResult:
    transfer_id, num_tokens, first_token, error, started_at, completed_at, metadata = wire
    return TransferResult(
        transfer_id, num_tokens, first_token, error, completed_at, started_at, bytes(metadata)
    )


class RankKVControl:
    """The driver's side: what each rank is to expect or cancel, and cancelled pages waiting for their rank.
    Not thread-safe: the worker calls it under its lock."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self._expects: list[list[list]] = [[] for _ in range(num_ranks)]
        self._cancels: list[list[int]] = [[] for _ in range(num_ranks)]
        self._held: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_ranks)]
        """Per rank: (transfer id, pages) cancelled, waiting for the round that carries the cancel."""
        self._sent: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_ranks)]
        """Per rank: cancelled pages whose cancel is in the round under way."""
        self.awaited: set[int] = set()
        """Transfers expected (queued or told to their rank) that have not arrived, failed or been cancelled."""

    def expect(self, rank: int, transfer_id: int, peer: str, pages: list[int], timeout_s: float):
        self._expects[rank].append([transfer_id, peer, list(pages), timeout_s])
        self.awaited.add(transfer_id)

    def cancel(self, rank: int, transfer_id: int, pages: list[int]) -> list[int]:
        """Cancels an expected transfer. Returns the pages that may be freed now (those of a transfer its rank
        was never told of); the others are freed by the worker once `delivered` hands them back."""
        self.awaited.discard(transfer_id)
        queued = [e for e in self._expects[rank] if e[0] == transfer_id]
        if queued:
            self._expects[rank].remove(queued[0])
            return list(pages)
        self._cancels[rank].append(transfer_id)
        self._held[rank].append((transfer_id, list(pages)))
        return []

    @property
    def pending(self) -> bool:
        """Whether a round is needed for KV alone: something to tell a rank, or a transfer still to come."""
        return bool(self.awaited) or any(self._cancels)

    def take(self) -> list | None:
        """The control of the next round (per rank `[expects, cancels]`), None when there is nothing to say.
        Call `delivered` once that round has returned."""
        if not any(self._expects) and not any(self._cancels):
            return None
        wire = [[e, c] for e, c in zip(self._expects, self._cancels, strict=True)]
        self._expects = [[] for _ in range(self.num_ranks)]
        self._cancels = [[] for _ in range(self.num_ranks)]
        self._sent, self._held = self._held, [[] for _ in range(self.num_ranks)]
        return wire

    def delivered(self) -> list[tuple[int, list[int]]]:
        """After the round that carried the last `take`: (rank, pages) of cancelled transfers, now free to go."""
        done = [(rank, pages) for rank, held in enumerate(self._sent) for _, pages in held]
        self._sent = [[] for _ in range(self.num_ranks)]
        return done

    def drop(self) -> list[tuple[int, list[int]]]:
        """Forgets everything (the ranks are gone): (rank, pages) of every cancelled transfer still held."""
        held = [(rank, pages) for rank, h in enumerate(self._held) for _, pages in h]
        held += self.delivered()
        self._held = [[] for _ in range(self.num_ranks)]
        self._expects = [[] for _ in range(self.num_ranks)]
        self._cancels = [[] for _ in range(self.num_ranks)]
        self.awaited.clear()
        return held

    def arrived(self, replies: list[list]) -> list[TransferResult]:
        """The ranks' arrivals of a round (each rank's list), those still awaited."""
        out = []
        for wire in replies:
            for arrival in wire:
                result = arrival_from_wire(arrival)
                if result.transfer_id in self.awaited:
                    self.awaited.discard(result.transfer_id)
                    out.append(result)
        return out


class RankKVEndpoint:
    """A rank's side: its `KVReceiver` over the rank's cache, driven by the control of each round."""

    def __init__(self, receiver: Any):
        self.receiver = receiver

    def apply(self, control: list | None) -> None:
        """Cancels, then expects what the driver said (control: this rank's `[expects, cancels]`)."""
        if control is None:
            return
        expects, cancels = control
        for transfer_id in cancels:
            self.receiver.cancel(transfer_id)  # returns once no piece can write its pages
        now = time.monotonic()
        for transfer_id, peer, pages, timeout_s in expects:
            self.receiver.expect(ExpectedTransfer(transfer_id, peer, pages, now + timeout_s))

    def poll(self) -> list[list]:
        """The transfers that arrived or failed since the last poll (arrival wire lists)."""
        return [arrival_to_wire(r) for r in self.receiver.poll()]

    def close(self) -> None:
        self.receiver.close()
