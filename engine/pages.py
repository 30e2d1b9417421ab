"""`PageAllocator`: hands out and takes back the page ids of one KV cache. Pure Python (no torch), so schedulers
that use it are tested without a GPU."""

from __future__ import annotations

import re

from pdserve.model.errors import CapacityError

_FREE, _TAKEN = 1, 0
_FREE_RUNS = re.compile(b"\x01+")


class PageAllocator:
    """First-fit allocator over a map of the pages. Every page is either free or owned by exactly one holder;
    freeing a page that is not allocated is a bug and raises.

    A request's pages come as one run of consecutive ids wherever a free run is long enough (the lowest such
    run), else as few runs as the free space allows (the longest free runs first). A run of pages is one
    contiguous block of the page-major cache, which the KV transfer moves as one message without copying it
    (pdserve.kvtransfer). Single pages (a decode step's growth) fill the lowest holes first, which keeps the
    long free runs whole."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages = num_pages
        self._map = bytearray([_FREE]) * num_pages
        """_FREE where a page can be handed out (searched with bytearray.find, at C speed)."""
        self._num_free = num_pages
        self._used: set[int] = set()
        self._held: list[int] | None = None

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        """Pages owned by requests (pages freed but held back count as free here)."""
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise CapacityError(f"need {n} KV pages, {self._num_free} free of {self.num_pages}")
        if n <= 0:
            return []
        start = self._map.find(bytes([_FREE]) * n)
        if start >= 0:
            pages = list(range(start, start + n))
            self._map[start : start + n] = bytes([_TAKEN]) * n
        else:  # the longest free runs first (lowest first among equals), until n pages
            runs = sorted(
                ((m.start(), m.end()) for m in _FREE_RUNS.finditer(self._map)),
                key=lambda run: (run[0] - run[1], run[0]),
            )
            pages = []
            for a, b in runs:
                b = min(b, a + n - len(pages))
                pages.extend(range(a, b))
                self._map[a:b] = bytes([_TAKEN]) * (b - a)
                if len(pages) == n:
                    break
        self._num_free -= n
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise AssertionError(f"page {p} freed but not allocated")
            self._used.remove(p)
            if self._held is not None:
                self._held.append(p)
            else:
                self._map[p] = _FREE
                self._num_free += 1

    def hold_frees(self) -> None:
        """Until `release_held`, freed pages are not handed out again: a forward pass in flight may still write
        pages of a request that was cancelled meanwhile."""
        self._held = []

    def release_held(self) -> None:
        held, self._held = self._held or [], None
        for p in held:
            self._map[p] = _FREE
        self._num_free += len(held)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
