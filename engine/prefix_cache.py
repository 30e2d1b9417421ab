"""`PrefixCache`: which of a request's KV pages it may share with other requests through the page allocator's
cache (`PageAllocator.cache`, `match`, `take`), and the counts of what it found. Pure Python (no torch).

A full page of a request's tokens is named by a hash chained through its parents: sha256 of its parent page's
hash and its own token ids (a cryptographic hash, so that a prompt cannot be made to collide with another
client's). A page is cached once a prefill pass of its request has computed it, and never written again; a new
request whose first pages are cached takes a reference to them and starts its prefill after them.

What the hash must cover: everything the page's KV rows depend on. The main layers' rows at a position depend on
the tokens up to it. Where the worker speculates, the MTP module's cache layer is a layer of the same pages, and
its row at position t is made from the main model's last hidden state at t and the token at t + 1
(`pdserve.engine.drafter`): the row at a page's last position depends on the first token of the next page,
which the page's own tokens do not fix (two prompts may share a page and go on differently). The hidden state
is not kept, so that row cannot be made again for a request that goes on otherwise; instead, with `lookahead`
the hash of a page covers the token after it too, and a page is cached only once that token is known (the
MTP pass wrote its row with it). A request then matches a page only where it goes on with the same token, so
every row it finds is the row it would have computed.

What a hit leaves to compute: at least the last token of the prefill, whose logits sample the next token
(vLLM's rule: a hit covers full pages within the first n - 1 tokens). In batch-invariant mode (`align`) a
prompt is cut only at multiples of the chunk size and a chunk's arithmetic depends on where it starts (what
is in the cache before it), so a hit is cut to a multiple of the chunk size as well: the request computes
exactly the chunks it would have without the hit, and its KV and logits are the bits they would have been.

On a decode worker (`Scheduler.reuse_held`) the full pages of the KV a prefill worker sends are cached as they
arrive, and a later request whose KV comes from a prefill worker starts from the cached pages of its first
tokens (`held_match`): they stand in for pages the prefill worker would have sent, which it computed as a
prefill of the same tokens computes them (in batch-invariant mode: in chunks starting at the same multiples of
the prefill pool's chunk size, so to the bit). This worker's own prefills cut prompts at its own chunk size,
so in batch-invariant mode the received pages hang off another root (RECEIVED_ROOT) and the two kinds never
stand in for each other.

Cache events: a `CacheEventLog` on the allocators records the pages' hashes cached and evicted, and on the host
pools (`pdserve.engine.host_tier`) the hashes stored in host memory and gone from it (dropped for a newer page, or
taken back to the GPU), which the worker sends to the router with its long-poll answers
(`messages.CacheEvents`); the router's index of them
(`pdserve.cluster.prefix_routing`) places requests where their prefix is. The router computes a prompt's chain
with the same function as the worker (`chain_hashes`) and compares the hashes' first `EVENT_HASH_BYTES` bytes:
its index only steers placement, so a rare collision there costs a miss, never a wrong page."""

from __future__ import annotations

import array
import hashlib
import math
from collections.abc import Sequence

from pdserve.engine.host_tier import HostPool
from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request

ROOT_HASH = b""
"""The parent of a request's first page."""
RECEIVED_ROOT = b"received"
"""The parent of the first page of KV a decode worker received from a prefill worker, where it keeps those apart
from the pages of its own prefills (`PrefixCache.received_root`)."""
_TOKEN_BYTES = 8
"""A token id's bytes in what a page's hash covers (array typecode "q")."""


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of a page whose parent page has hash `parent` (ROOT_HASH for the first page) and
    whose contents are determined by `token_ids` (its tokens, and with lookahead the token after them)."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()  # _TOKEN_BYTES


EVENT_HASH_BYTES = 8
"""Bytes of a page's hash in the cache events and the router's index (a prefix of the full hash)."""


def chain_hashes(
    tokens: Sequence[int], page_size: int, num_pages: int, lookahead: bool,
    parent: bytes = ROOT_HASH, first: int = 0,
) -> list[bytes]:  # fmt: skip
    """The chained hashes of pages `first` .. `num_pages` - 1 of a sequence of `tokens` (with lookahead the
    token after each page must be in `tokens`), the page before `first` having hash `parent`. What the worker
    caches a page under (`PrefixCache`) and what the router looks a prompt up with."""
    extra = 1 if lookahead else 0
    data = array.array("q", tokens[first * page_size : num_pages * page_size + extra]).tobytes()
    size = _TOKEN_BYTES * (page_size + extra)
    hashes = []
    for p in range(first, num_pages):
        at = _TOKEN_BYTES * (p - first) * page_size
        parent = hashlib.sha256(parent + data[at : at + size]).digest()
        hashes.append(parent)
    return hashes


def prompt_pages(num_tokens: int, page_size: int, hit_unit: int) -> int:
    """The most pages of a prefill of `num_tokens` tokens a hit can cover (`PrefixCache.match`)."""
    return max(0, (num_tokens - 1) // hit_unit * hit_unit) // page_size


class CacheEventLog:
    """The pages' hashes (their first EVENT_HASH_BYTES bytes) a worker's allocators cached and evicted, and its
    host pools stored and let go, since the last `drain`, as a net count per hash and tier. Bounded: past
    `max_hashes` distinct hashes of both tiers together it forgets them and marks the batch a reset, which `drain`
    answers with a snapshot of the hashes held now (the newest `max_hashes`, the GPU's first)."""

    def __init__(self, max_hashes: int = 4096):
        if max_hashes <= 0:
            raise ValueError(f"max_hashes={max_hashes}: must be positive")
        self.max_hashes = max_hashes
        self._delta: dict[bytes, int] = {}
        self._host_delta: dict[bytes, int] = {}
        self._reset = False

    def __bool__(self) -> bool:
        return self._reset or bool(self._delta) or bool(self._host_delta)

    def note(self, page_hash: bytes, delta: int, host: bool = False) -> None:
        """A page of hash `page_hash` was cached (+1) or evicted (-1) on the GPU, or with `host` stored in (+1)
        or gone from (-1) a host pool."""
        if self._reset:
            return
        counts = self._host_delta if host else self._delta
        key = page_hash[:EVENT_HASH_BYTES]
        n = counts.get(key, 0) + delta
        if n:
            counts[key] = n
        else:
            counts.pop(key, None)
        if len(self._delta) + len(self._host_delta) > self.max_hashes:
            self._delta.clear()
            self._host_delta.clear()
            self._reset = True

    def drain(
        self, allocators: Sequence[PageAllocator], host_pools: Sequence[HostPool] = ()
    ) -> tuple[list[bytes], list[bytes], bool, list[bytes], list[bytes]]:
        """(hashes cached, hashes evicted, reset, hashes stored on host, hashes gone from host) since the last
        call: `messages.CacheEvents`'s fields in order. After a reset the first list is what the allocators
        cache now and the fourth what `host_pools` store now (newest last, at most max_hashes together, the
        GPU's first), and the receiver forgets what it knew."""
        reset, self._reset = self._reset, False
        if reset:
            held = [h[:EVENT_HASH_BYTES] for a in allocators for h in a.cached_hashes()]
            held = held[-self.max_hashes :]
            room = self.max_hashes - len(held)
            stored = [h[:EVENT_HASH_BYTES] for p in host_pools for h in p.stored_hashes()]
            return held, [], True, stored[max(0, len(stored) - room) :] if room else [], []
        delta, self._delta = self._delta, {}
        host, self._host_delta = self._host_delta, {}
        return (*_split(delta), False, *_split(host))


def _split(delta: dict[bytes, int]) -> tuple[list[bytes], list[bytes]]:
    """A net count per hash as (one entry per copy added, one per copy gone)."""
    added = [h for h, n in delta.items() for _ in range(max(n, 0))]
    gone = [h for h, n in delta.items() for _ in range(max(-n, 0))]
    return added, gone


class PrefixCache:
    def __init__(
        self, page_size: int, lookahead: bool = False, align: int = 1,
        separate_received: bool = False,
    ):  # fmt: skip
        """lookahead: the page's hash covers the token after it (a worker that runs the MTP module, whose
        cache layer's row at a page's last position depends on that token); align: a hit is a multiple of
        this many tokens (batch-invariant mode: the chunk size; see the module docstring);
        separate_received (a decode worker in batch-invariant mode): the pages of decode-only requests
        (KV a prefill worker computed and sent) hang off RECEIVED_ROOT, so that they and the pages this
        worker prefilled itself never stand in for each other: the two cut prompts into chunks of other
        sizes, whose rows differ in the last bits."""
        if align <= 0:
            raise ValueError(f"align={align}: must be positive")
        self.page_size, self.lookahead = page_size, lookahead
        self.received_root = RECEIVED_ROOT if separate_received else ROOT_HASH
        """The parent of a decode-only request's first page."""
        self.hit_unit = math.lcm(page_size, align)
        """A hit is a multiple of this many tokens."""
        self.num_queries = 0
        """Tokens of the requests looked up (on their first admission here), and of them the tokens found
        cached: vLLM's prefix_cache_queries and prefix_cache_hits."""
        self.num_hits = 0

    def _hashes(self, request: Request, num_pages: int, tokens: Sequence[int]) -> list[bytes]:
        """The request's first `num_pages` page hashes (extending `request.page_hashes`); `tokens`: its
        tokens, with the token after them where known (lookahead)."""
        hashes = request.page_hashes
        first = len(hashes)
        if first < num_pages:
            root = self.received_root if request.policy is Policy.DECODE_ONLY else ROOT_HASH
            parent = hashes[-1] if hashes else root
            hashes.extend(
                chain_hashes(tokens, self.page_size, num_pages, self.lookahead, parent, first)
            )
        return hashes[:num_pages]

    def match(self, request: Request, allocator: PageAllocator, prefill_end: int) -> list[int]:
        """The cached pages the request may start from, for a prefill that ends at token `prefill_end` (no
        reference taken: `PageAllocator.take`)."""
        num_pages = prompt_pages(prefill_end, self.page_size, self.hit_unit)
        if num_pages <= 0:
            return []
        pages = allocator.match(self._hashes(request, num_pages, request.token_ids))
        per_unit = self.hit_unit // self.page_size
        return pages[: len(pages) // per_unit * per_unit]

    def host_match(
        self, request: Request, pool: HostPool, prefill_end: int, num_gpu: int
    ) -> list[bytes]:
        """The hashes of the pages after the request's `num_gpu` GPU-cached ones that host `pool` stores
        (a leading run, cut so that the whole hit stays a multiple of the hit unit), for a prefill that ends
        at token `prefill_end`."""
        num_pages = max(0, (prefill_end - 1) // self.hit_unit * self.hit_unit) // self.page_size
        if num_pages <= num_gpu:
            return []
        hashes = self._hashes(request, num_pages, request.token_ids)[num_gpu:]
        per_unit = self.hit_unit // self.page_size
        total = (num_gpu + pool.match(hashes)) // per_unit * per_unit
        return hashes[: max(0, total - num_gpu)]

    def count(self, request: Request, num_hit_tokens: int) -> None:
        """A request's first lookup here: `num_hit_tokens` of its tokens were cached (its usage's
        cached_tokens)."""
        request.num_cached_tokens = num_hit_tokens
        self.num_queries += request.num_tokens
        self.num_hits += num_hit_tokens

    def register(
        self, request: Request, allocator: PageAllocator, next_token: int | None = None
    ) -> None:
        """Caches the request's full pages that its prefill computed up to `request.num_computed` (those
        not cached yet); next_token: the token after its tokens, where its last chunk just sampled it."""
        self.register_upto(request, allocator, request.num_computed, next_token)

    def register_upto(
        self, request: Request, allocator: PageAllocator, end: int, next_token: int | None = None
    ) -> None:
        """Caches the request's full pages within its first `end` tokens, whose KV rows are final (never
        written again), those not cached yet; with lookahead only those whose next token is known."""
        tokens = request.token_ids
        known = len(tokens) + (next_token is not None)
        full = min(end, request.num_tokens) // self.page_size
        if self.lookahead:  # a page whose next token is not known yet waits (module docstring)
            full = min(full, (known - 1) // self.page_size)
        full = min(full, len(request.pages))
        if full <= request.num_cached_pages:
            return
        if next_token is not None and self.lookahead:
            tokens = [*tokens, next_token]
        hashes = self._hashes(request, full, tokens)
        for p in range(request.num_cached_pages, full):
            allocator.cache(request.pages[p], hashes[p])
        request.num_cached_pages = full

    def held_match(self, request: Request, allocator: PageAllocator) -> list[int]:
        """The cached pages standing in for the first pages of a request whose KV a prefill worker sends
        (a decode worker's hit: those pages need not travel; no reference taken). Every full page within
        its first n - 1 tokens may be found, with no hit unit: nothing is computed over them here, the
        prefill worker computes as it would without them, and a page found here holds the rows a prefill
        of the same tokens made (`pdserve.decode.worker`). The page with the last token is never
        found, so that at least one page travels (the transfer's last page comes with its first token)."""
        num_pages = (request.num_tokens - 1) // self.page_size
        if num_pages <= 0:
            return []
        return allocator.match(self._hashes(request, num_pages, request.token_ids))
