"""`PageAllocator`: hands out and takes back the page ids of one KV cache. Pure Python (no torch), so schedulers
that use it are tested without a GPU."""

from __future__ import annotations

from collections import deque

from .errors import CapacityError


class PageAllocator:
    """Free-list allocator. Every page is either free or owned by exactly one holder; freeing a page that is not
    allocated is a bug and raises."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()
        self._held: list[int] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages owned by requests (pages freed but held back count as free here)."""
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"need {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
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
                self._free.append(p)

    def hold_frees(self) -> None:
        """Until `release_held`, freed pages are not handed out again: a forward pass in flight may still write
        pages of a request that was cancelled meanwhile."""
        self._held = []

    def release_held(self) -> None:
        held, self._held = self._held or [], None
        self._free.extend(held)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
