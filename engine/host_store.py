"""`HostKVStore`: the host memory of the host tier (`pdserve.engine.host_tier`) and the copies between it and a
`PagedKVCache`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.host_tier import OFFLOAD, HostCopy, copy_runs
from pdserve.model.kv_cache import PagedKVCache


def host_slots(host_bytes: int, page_bytes: int) -> int:
    """Slots of a host pool of `host_bytes` for pages of `page_bytes` (0: the tier is off)."""
    if host_bytes < 0:
        raise ValueError(f"host KV cache bytes={host_bytes}: must be >= 0")
    if 0 < host_bytes < page_bytes:
        raise ValueError(
            f"host KV cache bytes={host_bytes}: less than one KV page ({page_bytes} bytes); 0 turns "
            "the host tier off"
        )
    return host_bytes // page_bytes


class HostKVStore:
    """`num_slots` pages of host memory shaped like `cache`'s pages: pinned where the cache is on a GPU (so
    that copies run asynchronously at the link's bandwidth), plain memory on the CPU."""

    def __init__(self, cache: PagedKVCache, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots={num_slots}: must be positive")
        self.cache = cache
        on_gpu = cache.device.type == "cuda"
        self.data = torch.empty(
            (num_slots, *cache.data.shape[1:]), dtype=cache.data.dtype, pin_memory=on_gpu
        )
        self.stream = torch.cuda.Stream(cache.device) if on_gpu else None
        self.bytes_copied = 0
        """Bytes copied either way since start."""
        self._issued: torch.cuda.Event | None = None
        """Recorded after the last copies `issue` started (a GPU's): each step waits for it (at once where
        they are done)."""

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    def run(self, copies: Sequence[HostCopy]) -> None:
        """Issues `copies` (a plan's, `StepPlan.host_copies`) in order after the work queued so far; on a GPU
        the current stream waits for them without blocking the host."""
        if not copies:
            return
        if self.stream is None:
            self._copy(copies, False)
            return
        main = torch.cuda.current_stream(self.cache.device)
        self.stream.wait_stream(main)  # evicted pages are read after the passes that wrote them
        with torch.cuda.stream(self.stream):
            self._copy(copies, True)
        main.wait_stream(self.stream)  # an event: the step's passes run after the copies

    def issue(self, copies: Sequence[HostCopy]) -> None:
        """Issues `copies` now, from any thread, while a step may be running: they touch no page the step in
        flight writes or reads for a live request (evicted pages are cached ones, never written; restored
        pages were free or cached and unreferenced when the step was planned), so they wait for nothing and
        overlap it. The next step's passes wait for them (`wait`)."""
        if not copies:
            return
        if self.stream is None:
            self._copy(copies, False)
            return
        with torch.cuda.device(self.cache.device), torch.cuda.stream(self.stream):
            self._copy(copies, True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._issued = event

    def wait(self) -> None:
        """Makes the current stream wait for the copies `issue` started (none on the CPU, whose copies are
        done when issued)."""
        event = (
            self._issued
        )  # kept: an issue from another thread meanwhile is the next step's to wait for
        if event is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(event)

    def _copy(self, copies: Sequence[HostCopy], non_blocking: bool) -> None:
        gpu, host = self.cache.data, self.data
        runs = copy_runs(copies)
        for kind, page, slot, n in runs:
            if kind == OFFLOAD:
                host[slot : slot + n].copy_(gpu[page : page + n], non_blocking=non_blocking)
            else:
                gpu[page : page + n].copy_(host[slot : slot + n], non_blocking=non_blocking)
        self.bytes_copied += sum(n for *_, n in runs) * self.cache.layout.page_bytes
