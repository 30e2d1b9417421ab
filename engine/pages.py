"""`PageAllocator`: hands out and takes back the page ids of one KV cache, counts the requests that share a page,
and keeps the pages of the prefix cache (`pdserve.engine.prefix_cache` decides which pages those are). Pure Python
(no torch), so schedulers that use it are tested without a GPU."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.model.errors import CapacityError

_FREE, _TAKEN = 1, 0
_FREE_RUNS = re.compile(b"\x01+")


class PageAllocator:
    """First-fit allocator over a map of the pages. A page is free, referenced by one or more holders (a page
    of the prefix cache may be shared), or cached and unreferenced; freeing a page that holds no reference is
    a bug and raises.

    A request's pages come as one run of consecutive ids wherever a free run is long enough (the lowest such
    run), else as few runs as the free space allows (the longest free runs first). A run of pages is one
    contiguous block of the page-major cache, which the KV transfer moves as one message without copying it
    (pdserve.kvtransfer). Single pages (a decode step's growth) fill the lowest holes first, which keeps the
    long free runs whole.

    The prefix cache: `cache` names a referenced page by the hash of its contents; `match` finds the pages of
    a chain of hashes and `take` references them. A cached page is never written again (its contents are
    what its hash says), so when its last reference goes it stays cached, unreferenced, and counts as free:
    `allocate` evicts the least recently released of those only when the free pages are not enough, and an
    evicted page loses its hash. `hold_frees` does not hold cached pages back (nothing writes them)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages = num_pages
        self._map = bytearray([_FREE]) * num_pages
        """_FREE where a page can be handed out without evicting (searched with bytearray.find, at C
        speed)."""
        self._num_unmapped = num_pages
        """Pages marked _FREE in the map."""
        self._refs: dict[int, int] = {}
        """Referenced pages: how many holders each has."""
        self._held: list[int] | None = None
        self._hash_of: dict[int, bytes] = {}
        """Cached pages (referenced or not): their hash."""
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached pages nobody references, least recently released first."""
        self.num_evicted = 0
        """Cached pages evicted since start."""
        self.events = None
        """A `prefix_cache.CacheEventLog` told of each page cached and evicted (the router's cache events), or
        None."""
        self.on_evict: Callable[[int, bytes], None] | None = None
        """Called with each cached page evicted and its hash, before the page is handed out again (the host
        tier stores it: `pdserve.engine.host_tier`)."""

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones and unreferenced cached ones."""
        return self._num_unmapped + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by requests (pages freed but held back, and unreferenced cached pages, count as
        free here)."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Pages in the prefix cache, referenced or not."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n pages, one reference each, uncached. Evicts unreferenced cached pages, least recently released
        first, only as far as the free pages fall short."""
        if n > self.num_free:
            raise CapacityError(f"need {n} KV pages, {self.num_free} free of {self.num_pages}")
        if n <= 0:
            return []
        while self._num_unmapped < n:
            self._evict()
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
        self._num_unmapped -= n
        for p in pages:
            self._refs[p] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; a page whose last reference goes is free again (after
        `release_held` where frees are held), or cached and unreferenced, released in the order given: a
        request's pages go last first, so that the first pages of its prompt (its hash chain's roots, which
        any hit needs and more prompts share) are evicted last."""
        for p in pages:
            refs = self._refs.get(p)
            if refs is None:
                raise AssertionError(f"page {p} freed but not allocated")
            if refs > 1:
                self._refs[p] = refs - 1
                continue
            del self._refs[p]
            if p in self._hash_of:
                self._evictable[p] = None  # the most recently released
            elif self._held is not None:
                self._held.append(p)
            else:
                self._map[p] = _FREE
                self._num_unmapped += 1

    def hold_frees(self) -> None:
        """Until `release_held`, freed pages are not handed out again: a forward pass in flight may still write
        pages of a request that was cancelled meanwhile."""
        self._held = []

    def release_held(self) -> None:
        held, self._held = self._held or [], None
        for p in held:
            self._map[p] = _FREE
        self._num_unmapped += len(held)

    # The prefix cache.

    def cache(self, page: int, page_hash: bytes) -> bool:
        """Names referenced `page` by the hash of its contents, from now on never written. False (and nothing
        changes) where the page is cached already or another page has that hash (two requests computed the
        same contents at once: the first stays the cached one)."""
        assert page in self._refs, f"page {page} cached but not referenced"
        if page in self._hash_of or page_hash in self._page_of:
            return False
        self._hash_of[page] = page_hash
        self._page_of[page_hash] = page
        if self.events is not None:
            self.events.note(page_hash, 1)
        return True

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest leading run of `hashes` (a request's chain), in order; takes no
        reference (`take` does)."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def cached_hashes(self) -> list[bytes]:
        """The hashes of the cached pages, in the order they were cached."""
        return list(self._hash_of.values())

    def cost(self, cached: Sequence[int]) -> int:
        """Free pages that taking `cached` (a match) uses up: those nobody references."""
        return sum(p in self._evictable for p in cached)

    def take(self, cached: Sequence[int]) -> None:
        """One more reference to each of `cached` (pages `match` returned, not evicted since)."""
        for p in cached:
            assert p in self._hash_of, f"page {p} taken but not cached"
            if p in self._refs:
                self._refs[p] += 1
            else:
                del self._evictable[p]
                self._refs[p] = 1

    def _evict(self) -> None:
        page, _ = self._evictable.popitem(last=False)
        page_hash = self._hash_of.pop(page)
        del self._page_of[page_hash]
        if self.events is not None:
            self.events.note(page_hash, -1)
        if self.on_evict is not None:
            self.on_evict(page, page_hash)
        self._map[page] = _FREE
        self._num_unmapped += 1
        self.num_evicted += 1

    def check(self) -> None:
        """Raises AssertionError where the allocator's books disagree (tests: every page is free, held,
        referenced or cached-and-unreferenced, exactly one of them)."""
        free = {i for i, v in enumerate(self._map) if v == _FREE}
        held = set(self._held or ())
        evictable = set(self._evictable)
        referenced = set(self._refs)
        assert len(free) == self._num_unmapped, "free count"
        parts = [free, held, evictable, referenced]
        assert sum(map(len, parts)) == self.num_pages, "a page in two states, or in none"
        assert set().union(*parts) == set(range(self.num_pages)), "a page in no state"
        assert evictable <= set(self._hash_of), "an evictable page not cached"
        assert set(self._hash_of) <= evictable | referenced, "a cached page free or held"
        assert {self._page_of[h] for h in self._hash_of.values()} == set(self._hash_of), "hash map"
        assert all(n > 0 for n in self._refs.values()), "a reference count below one"


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
