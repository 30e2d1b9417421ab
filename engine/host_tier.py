"""The host-memory tier below the GPU prefix cache: cached KV pages the page allocator evicts are copied to a
bounded pool of host memory, named by the same chained hash (`pdserve.engine.prefix_cache`), and copied back
into fresh GPU pages when a later prompt goes on past its GPU hit into pages the host pool holds.

Two halves, as the scheduler and the runner split everything:

- `HostPool` (pure Python, the scheduler's): which hash each host slot holds, least recently stored first, and
  the copies the next step must run before its forward passes, in the order they were decided (`HostCopy`).
  The allocator calls `offload` for each cached page it evicts (`PageAllocator.on_evict`); the scheduler calls
  `take` for the slots a new request restores from, then `restore` once it has pages for them. A slot a
  restore reads is held until the step that copies it is finished, so no offload of the same step overwrites
  it; a restore moves its page out of the host pool (the GPU holds it again, and its next eviction stores it
  again).
- `HostKVStore` (torch, the runner's, `pdserve.engine.host_store`): the slots' memory, [num_slots, num_layers,
  page_size, entry_dim] like the GPU cache's pages (every layer's rows of a page, the MTP layer's included,
  fp8 rows as bytes), pinned on a CUDA machine; copies batched into runs of consecutive pages and slots on a
  side stream. A worker issues them as soon as the scheduler decides them (`Scheduler.issue_host_copies`,
  `HostKVStore.issue`): a request admitted while a step runs has its pages restored during that step, which
  touches none of them (an evicted page is a cached one, never written again; a restored page was free or
  cached and unreferenced when the step was planned). The next step's compute stream waits on the copies'
  event before its passes (`HostKVStore.wait`); the host thread never waits. Without a worker's hook each
  plan carries the copies decided before it (`StepPlan.host_copies`, `HostKVStore.run`). On the CPU the
  same paths copy synchronously.

Pages a KV transfer writes (a decode-only request's, written by the prefill worker outside any step) must have
no copy pending or running: the scheduler stores no page evicted for such a request (`drop`), and refuses it
(full for now) where a page it gets has a copy pending or in flight (its holder went away before the copy ran).

Copies run in decision order: an offload that reads a page queued before a restore that writes it (the page
was evicted and handed to the restoring request) reads it first, and a restore of a slot an offload of the
same batch wrote reads what was written."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

OFFLOAD, RESTORE = "offload", "restore"


@dataclasses.dataclass(frozen=True, slots=True)
class HostCopy:
    """One page copy between the GPU cache and the host pool."""

    kind: str
    """OFFLOAD (GPU page to host slot) or RESTORE (host slot to GPU page)."""
    page: int
    slot: int


class HostPool:
    """The bookkeeping of `num_slots` host slots of one KV cache (one per data-parallel rank)."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots={num_slots}: must be positive")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        """Stored pages' hash -> slot, least recently stored (or found) first."""
        self._free = list(range(num_slots - 1, -1, -1))
        """Slots holding nothing, lowest last (popped first: a batch gets runs of consecutive slots)."""
        self._taken: list[int] = []
        """Slots a restore reads, not yet queued as copies."""
        self._held: list[int] = []
        """Slots queued to be read by a restore: free again after the step that copies them."""
        self._copies: list[HostCopy] = []
        self.num_offloaded = 0
        """Pages stored since start."""
        self.num_restored = 0
        """Pages restored since start (host hits, in pages)."""
        self.num_dropped = 0
        """Evicted pages not stored: every slot was held by restores in flight."""
        self.events = None
        """A `prefix_cache.CacheEventLog` told of each hash stored here (+1) and gone from here (-1: its slot
        went to a newer page, or a restore took it back to the GPU), for the router's index; or None."""

    @property
    def num_stored(self) -> int:
        return len(self._slot_of)

    def offload(self, page: int, page_hash: bytes) -> None:
        """The allocator evicted cached `page`: store it (unless stored already), evicting the least recently
        stored slot when none is free."""
        if page_hash in self._slot_of:
            self._slot_of.move_to_end(page_hash)
            return
        if self._free:
            slot = self._free.pop()
        elif self._slot_of:
            old_hash, slot = self._slot_of.popitem(last=False)
            if self.events is not None:
                self.events.note(old_hash, -1, host=True)
        else:
            self.num_dropped += 1
            return
        self._slot_of[page_hash] = slot
        if self.events is not None:
            self.events.note(page_hash, 1, host=True)
        self._copies.append(HostCopy(OFFLOAD, page, slot))
        self.num_offloaded += 1

    def drop(self, page: int, page_hash: bytes) -> None:
        """The allocator evicted cached `page` for a holder that writes it outside the steps (a KV transfer):
        not stored, since no copy could read it in time."""
        self.num_dropped += 1

    def stored_hashes(self) -> list[bytes]:
        """The hashes stored, least recently stored (or found) first."""
        return list(self._slot_of)

    def busy_pages(self) -> set[int]:
        """Pages a pending copy reads or writes."""
        return {c.page for c in self._copies}

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (the chain after a GPU hit) are stored, as a leading run."""
        n = 0
        for h in hashes:
            if h not in self._slot_of:
                break
            n += 1
        return n

    def take(self, hashes: Sequence[bytes]) -> list[int]:
        """Takes the slots of `hashes` (all stored: `match`) out of the pool for restores; each must then
        be `restore`d (or `untake`n)."""
        slots = [self._slot_of.pop(h) for h in hashes]
        self._taken.extend(slots)
        if self.events is not None:
            for h in hashes:
                self.events.note(h, -1, host=True)
        return slots

    def untake(self, slots: Sequence[int]) -> None:
        """Slots `take` returned that will not be restored (the pages for them could not be had): free."""
        for s in slots:
            self._taken.remove(s)
            self._free.append(s)

    def restore(self, slot: int, page: int) -> None:
        """Queues the copy of taken `slot` into GPU `page`; the slot is free after the step that runs it."""
        self._taken.remove(slot)
        self._held.append(slot)
        self._copies.append(HostCopy(RESTORE, page, slot))
        self.num_restored += 1

    def pending(self) -> list[HostCopy]:
        """The copies decided since the last `take_copies`."""
        return list(self._copies)

    def take_copies(self) -> tuple[list[HostCopy], list[int]]:
        """The copies the next step runs, in order, and the slots they read (for `release` after it)."""
        copies, self._copies = self._copies, []
        held, self._held = self._held, []
        return copies, held

    def release(self, slots: Sequence[int]) -> None:
        """The step that copied out of `slots` is finished: they are free."""
        self._free.extend(slots)
        self._free.sort(reverse=True)

    def check(self, in_flight: Sequence[int] = ()) -> None:
        """Raises AssertionError where the books disagree (tests): every slot is free, stored, taken, held
        or read by the step in flight (`in_flight`), exactly one of them."""
        parts = [self._free, list(self._slot_of.values()), self._taken, self._held, list(in_flight)]
        every = [s for part in parts for s in part]
        assert len(every) == self.num_slots, f"{len(every)} slots in the books of {self.num_slots}"
        assert sorted(every) == list(range(self.num_slots)), "a slot in two states"


def copy_runs(copies: Sequence[HostCopy]) -> list[tuple[str, int, int, int]]:
    """`copies` as (kind, first page, first slot, count) runs of one kind over consecutive pages and
    consecutive slots, in order: each run is one copy."""
    runs: list[tuple[str, int, int, int]] = []
    for c in copies:
        if runs:
            kind, page, slot, n = runs[-1]
            if kind == c.kind and c.page == page + n and c.slot == slot + n:
                runs[-1] = (kind, page, slot, n + 1)
                continue
        runs.append((c.kind, c.page, c.slot, 1))
    return runs
