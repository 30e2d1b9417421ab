"""Prefix-aware placement: the router's index of which prompt pages each worker's prefix cache holds, and the
choice of the worker that computes a request's prompt by the tokens it would find there and the worker's load.

The index. A worker whose prefix cache is on reports the pages it cached and evicted with its long-poll answers
(`messages.CacheEvents`: the first bytes of each page's chained hash, a net count per hash, bounded per answer;
`engine.prefix_cache.CacheEventLog`). `PrefixIndex` keeps a count per hash per worker. It is approximate (events
arrive a poll late, a log that overflowed sends only its newest hashes) and only steers placement: the worker
itself matches the prompt against its own cache, so a stale index costs a miss, never a wrong token. A prompt's
pages count as on the worker it was placed on from its placement (`PrefixIndex.expect`) until that worker's events
say so, or for PENDING_S at most: a burst of prompts that share a new prefix sees it where the first one went.

The request's pages. The router hashes a prompt as the worker does (`prefix_cache.chain_hashes`, the worker's
page size; with `lookahead`, where the worker speculates, a page's hash covers the token after the page too) and
counts the leading pages the worker's index holds, cut as the worker cuts a hit (`prefix_cache.prompt_pages`:
within the first n - 1 tokens, a multiple of its `hit_unit`). That many tokens are the worker's expected hit.

The policy (`router.prefix_aware_routing`, on by default). Among the workers that may compute the prompt (prefill
workers large enough for it; with none, the decode workers with room for it, which prefill it themselves), the
router picks the one with the highest

    expected hit tokens - router.prefix_load_weight x its queued prompt tokens

(queued: prompt tokens placed on it whose first token has not come yet), ties going to the less loaded and then
to the load-only order. With weight 1 this is the worker where the fewest prompt tokens are computed before this
request's first token: its queue plus the part of its prompt not cached there. A larger weight favours balance,
a smaller one reuse; with the setting off (or where no worker reports a cache) the least loaded worker is chosen,
as before.

A decode worker that receives its KV from a prefill worker and keeps the pages it holds (`reuse_held` in its
`ready` answer: `DecodeConfig.reuse_held_prefix`) gets only the pages after those it holds of the prompt (the
previous turn of the conversation). Among the decode workers with room for the rest, the router picks the one
with the highest

    expected held pages + router.prefix_load_weight x its free pages

(`rank_by_held`; weight 1: the most room after this request, whose held pages it does not take again; weight
0: the most pages held), ties to the most free pages, the fewest running, then the given order.
The decode worker itself matches the prompt when it reserves the pages and references them at once, so a
stale index costs pages sent, never a wrong page; the pages of a prompt placed there count as held from its
placement (`PrefixIndex.expect`). Those pages' hashes chain from the worker's `held_root` (in batch-invariant
mode not the root of the pages it prefills itself: `engine.prefix_cache.RECEIVED_ROOT`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pdserve.engine.messages import CacheEvents
from pdserve.engine.prefix_cache import EVENT_HASH_BYTES, ROOT_HASH, chain_hashes, prompt_pages

PENDING_S = 10.0
"""How long a placed prompt's pages count as on its worker without that worker's events saying so."""
MAX_PENDING = 1 << 16
"""Pages expected per worker at most; past it the expired ones go, and if still too many, all."""


@dataclasses.dataclass(eq=False)
class PrefixIndex:
    """Which page hashes one worker's prefix cache holds, by its cache events; how it hashes a prompt."""

    page_size: int
    hit_unit: int
    """A hit there is a multiple of this many tokens (`PrefixCache.hit_unit`)."""
    lookahead: bool
    """A page's hash covers the token after it (`PrefixCache.lookahead`)."""
    reuse_held: bool = False
    """A decode worker that keeps the pages of the KV it receives and reserves a request's held first pages
    (`Scheduler.reuse_held`)."""
    held_root: bytes = ROOT_HASH
    """The parent of the first page of that KV (`PrefixCache.received_root`)."""
    counts: dict[bytes, int] = dataclasses.field(default_factory=dict)
    """Per hash (its first EVENT_HASH_BYTES bytes): the copies cached (one per rank holding it)."""
    pending: dict[bytes, float] = dataclasses.field(default_factory=dict)
    """Hashes of pages of prompts placed here that its events have not reported yet: until when they count."""

    @classmethod
    def from_info(cls, info: dict[str, Any] | None) -> PrefixIndex | None:
        """From the worker's `ready` answer's "prefix_cache" (`engine.worker.prefix_cache_info`); None with
        the cache off there."""
        if not info:
            return None
        return cls(
            int(info["page_size"]), int(info["hit_unit"]), bool(info["lookahead"]),
            bool(info.get("reuse_held", False)), bytes.fromhex(info.get("held_root", "")),
        )  # fmt: skip

    def apply(self, events: CacheEvents) -> None:
        if events.reset:
            self.counts.clear()
        counts, pending = self.counts, self.pending
        for h in events.added:
            counts[h] = counts.get(h, 0) + 1
            pending.pop(h, None)
        for h in events.evicted:
            pending.pop(h, None)
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            else:
                counts.pop(h, None)

    def expect(self, hashes: Sequence[bytes], now: float) -> None:
        """A prompt whose pages have these hashes was placed here: they count as cached here for PENDING_S."""
        pending = self.pending
        if len(pending) + len(hashes) > MAX_PENDING:
            for h in [h for h, until in pending.items() if until <= now]:
                del pending[h]
            if len(pending) + len(hashes) > MAX_PENDING:
                pending.clear()
        until = now + PENDING_S
        for h in hashes:
            if h not in self.counts:
                pending[h] = until

    def hit_tokens(self, hashes: Sequence[bytes], num_tokens: int, now: float = 0.0) -> int:
        """Tokens a prefill of `num_tokens` tokens whose page hashes are `hashes` (short ones) would find here
        (pages expected here count until their time at `now`)."""
        limit = prompt_pages(num_tokens, self.page_size, self.hit_unit)
        pages = 0
        for h in hashes[:limit]:
            if h not in self.counts and self.pending.get(h, 0.0) <= now:
                break
            pages += 1
        return pages * self.page_size // self.hit_unit * self.hit_unit

    def held_pages(self, hashes: Sequence[bytes], now: float = 0.0) -> int:
        """The leading pages of a prompt whose page hashes are `hashes` that a decode worker would hold for
        its transfer (`PrefixCache.held_match`: every full page within the first n - 1 tokens, no hit unit;
        `PromptHashes.of` makes no more)."""
        pages = 0
        for h in hashes:
            if h not in self.counts and self.pending.get(h, 0.0) <= now:
                break
            pages += 1
        return pages


class PromptHashes:
    """A prompt's page hashes as the router compares them (short), made once per (page size, lookahead)."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = tokens
        self._made: dict[tuple[int, bool], list[bytes]] = {}

    def of(self, index: PrefixIndex, root: bytes = ROOT_HASH) -> list[bytes]:
        """The hashes `index`'s worker names the prompt's pages by, chained from `root`."""
        key = (index.page_size, index.lookahead, root)
        hashes = self._made.get(key)
        if hashes is None:
            n = len(self.tokens)
            num_pages = prompt_pages(n, index.page_size, index.page_size)
            if index.lookahead:  # the token after the page must be known
                num_pages = min(num_pages, (n - 1) // index.page_size)
            full = chain_hashes(self.tokens, index.page_size, num_pages, index.lookahead, root)
            hashes = self._made[key] = [h[:EVENT_HASH_BYTES] for h in full]
        return hashes

    def hit_tokens(self, index: PrefixIndex | None, now: float = 0.0) -> int:
        return 0 if index is None else index.hit_tokens(self.of(index), len(self.tokens), now)

    def held_pages(self, index: PrefixIndex | None, now: float = 0.0) -> int:
        if index is None or not index.reuse_held:
            return 0
        return index.held_pages(self.of(index, index.held_root), now)


def rank_by_prefix(
    workers: Iterable[Any], prompt: PromptHashes, load: Callable[[Any], float], weight: float,
    index: Callable[[Any], PrefixIndex | None],
) -> tuple[list[Any], dict[Any, int]]:  # fmt: skip
    """`workers` (in their load-only order of preference) best first by the policy of the module docstring:
    expected hit tokens minus `weight` x `load`, ties to the lower load, then to the given order; and each
    one's expected hit tokens."""
    workers = list(workers)
    if not any(index(w) is not None for w in workers):
        return workers, {}
    now = time.monotonic()
    hits = {w: prompt.hit_tokens(index(w), now) for w in workers}
    scored = [(weight * load(w) - hits[w], load(w), i, w) for i, w in enumerate(workers)]
    scored.sort(key=lambda s: s[:3])
    return [s[3] for s in scored], hits


def rank_by_held(
    decodes: Iterable[Any], prompt: PromptHashes, free_pages: Callable[[Any], int],
    num_running: Callable[[Any], int], weight: float, index: Callable[[Any], PrefixIndex | None],
) -> tuple[list[Any], dict[Any, int]]:  # fmt: skip
    """`decodes` (with room for the request, in their load-only order of preference) best first by the
    module docstring's decode policy: expected held pages plus `weight` x free pages, ties to the most free
    pages, the fewest running, then the given order; and each one's expected held pages."""
    decodes = list(decodes)
    now = time.monotonic()
    held = {d: prompt.held_pages(index(d), now) for d in decodes}
    if not any(held.values()):
        return decodes, held

    def key(item: tuple[int, Any]) -> tuple:
        i, d = item
        return (-(held[d] + weight * free_pages(d)), -free_pages(d), num_running(d), i)

    return [d for _, d in sorted(enumerate(decodes), key=key)], held
