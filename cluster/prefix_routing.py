"""Prefix-aware placement: the router's index of which prompt pages each worker's prefix cache holds, and the
choice of the worker that computes a request's prompt by the tokens it would find there and the worker's load.

The index. A worker whose prefix cache is on reports the pages it cached and evicted with its long-poll answers
(`messages.CacheEvents`: the first bytes of each page's chained hash, a net count per hash, bounded per answer;
`engine.prefix_cache.CacheEventLog`). `PrefixIndex` keeps a count per hash per worker. It is approximate (events
arrive a poll late, a log that overflowed sends only its newest hashes) and only steers placement: the worker
itself matches the prompt against its own cache, so a stale index costs a miss, never a wrong token. A prompt's
pages count as on the worker it was placed on from its placement (`PrefixIndex.expect`) until that worker's events
say so, or for PENDING_S at most: a burst of prompts that share a new prefix sees it where the first one went.
With the host tier on (`engine.host_tier`) the events also say which pages went to the worker's host memory and
which left it (restored to the GPU, or their slot given to a newer page): `PrefixIndex.host_counts`.

The request's pages. The router hashes a prompt as the worker does (`prefix_cache.chain_hashes`, the worker's
page size; with `lookahead`, where the worker speculates, a page's hash covers the token after the page too) and
counts the leading pages the worker's index holds, cut as the worker cuts a hit (`prefix_cache.prompt_pages`:
within the first n - 1 tokens, a multiple of its `hit_unit`). That many tokens are the worker's expected GPU hit;
the leading pages after them that its host tier holds, cut so that the whole hit stays a multiple of the hit unit
(`PrefixCache.host_match`), are its expected host hit.

The policy (`router.prefix_aware_routing`, on by default). Among the workers that may compute the prompt (prefill
workers large enough for it; with none, the decode workers with room for it, which prefill it themselves), the
router picks the one with the highest

    expected GPU hit tokens + router.prefix_host_hit_weight x expected host hit tokens
        - router.prefix_load_weight x its queued prompt tokens

(queued: prompt tokens placed on it whose first token has not come yet), ties going to the less loaded and then
to the load-only order. With weight 1 this is the worker where the fewest prompt tokens are computed before this
request's first token: its queue plus the part of its prompt not cached there. A larger weight favours balance,
a smaller one reuse; with the setting off (or where no worker reports a cache) the least loaded worker is chosen,
as before. A host hit is not computed either, but its pages are copied back over the host link first
(`HOST_HIT_WEIGHT` says why it counts as it does), so a worker holding the prefix on host attracts the request
over an equally loaded one that holds nothing, and one holding it on its GPU over both.

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

HOST_HIT_WEIGHT = 0.75
"""The default of `router.prefix_host_hit_weight`: what a prompt token expected in a worker's host tier counts for,
against one expected in its GPU prefix cache (1) and one queued there (`prefix_load_weight`). A host hit saves the
token's prefill as a GPU hit does, so it counts for most of one: on a model with MLA a page's latent rows are few
bytes against the work of computing them (every layer's projections and experts), so restoring a page costs far
less than prefilling it. Not all of one: the restore takes host-to-device bandwidth (shared with the tier's
offloads) before the request's first chunk runs, and it takes fresh GPU pages (the GPU hit's pages are taken as
they are); and the host contents the index knows are the less certain (a host pool lets its oldest pages go as
the GPU evicts new ones, which the router learns a poll late). Three quarters keeps a GPU hit of the same length
clearly ahead, while a host-held prefix still outweighs a queue of up to three quarters of its length (at load
weight 1)."""
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
    host_counts: dict[bytes, int] = dataclasses.field(default_factory=dict)
    """Per hash: the copies stored in the worker's host tier (one per rank's host pool holding it)."""
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
            self.host_counts.clear()
        counts, pending = self.counts, self.pending
        for h in events.added:
            counts[h] = counts.get(h, 0) + 1
            pending.pop(h, None)
        for h in events.evicted:
            pending.pop(h, None)
            _decrement(counts, h)
        host = self.host_counts
        for h in events.host_added:
            host[h] = host.get(h, 0) + 1
        for h in events.host_evicted:
            _decrement(host, h)

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
        """Tokens a prefill of `num_tokens` tokens whose page hashes are `hashes` (short ones) would find here,
        on the GPU or in the host tier (`hits`)."""
        return sum(self.hits(hashes, num_tokens, now))

    def hits(self, hashes: Sequence[bytes], num_tokens: int, now: float = 0.0) -> tuple[int, int]:
        """(GPU hit tokens, host hit tokens) a prefill of `num_tokens` tokens whose page hashes are `hashes`
        (short ones) would find here, as the worker cuts them (`PrefixCache.match`, `host_match`): the leading
        pages cached (pages expected here count until their time at `now`), a multiple of the hit unit, then
        the leading pages after those in the host tier, cut so that the whole stays a multiple of it."""
        limit = prompt_pages(num_tokens, self.page_size, self.hit_unit)
        pages = 0
        for h in hashes[:limit]:
            if h not in self.counts and self.pending.get(h, 0.0) <= now:
                break
            pages += 1
        gpu = pages * self.page_size // self.hit_unit * self.hit_unit
        host = self.host_counts
        if not host:
            return gpu, 0
        pages = gpu // self.page_size
        for h in hashes[pages:limit]:
            if h not in host:
                break
            pages += 1
        return gpu, pages * self.page_size // self.hit_unit * self.hit_unit - gpu

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

    def hits(self, index: PrefixIndex | None, now: float = 0.0) -> tuple[int, int]:
        """(GPU hit tokens, host hit tokens) expected on `index`'s worker (`PrefixIndex.hits`)."""
        return (0, 0) if index is None else index.hits(self.of(index), len(self.tokens), now)

    def held_pages(self, index: PrefixIndex | None, now: float = 0.0) -> int:
        if index is None or not index.reuse_held:
            return 0
        return index.held_pages(self.of(index, index.held_root), now)


def rank_by_prefix(
    workers: Iterable[Any], prompt: PromptHashes, load: Callable[[Any], float], weight: float,
    index: Callable[[Any], PrefixIndex | None], host_weight: float = HOST_HIT_WEIGHT,
) -> tuple[list[Any], dict[Any, int]]:  # fmt: skip
    """`workers` (in their load-only order of preference) best first by the policy of the module docstring:
    expected GPU hit tokens plus `host_weight` x expected host hit tokens minus `weight` x `load`, ties to the
    lower load, then to the given order; and each one's expected hit tokens (GPU and host together: the
    tokens it does not compute)."""
    workers = list(workers)
    if not any(index(w) is not None for w in workers):
        return workers, {}
    now = time.monotonic()
    split = {w: prompt.hits(index(w), now) for w in workers}
    scored = [
        (weight * load(w) - split[w][0] - host_weight * split[w][1], load(w), i, w)
        for i, w in enumerate(workers)
    ]
    scored.sort(key=lambda s: s[:3])
    return [s[3] for s in scored], {w: sum(split[w]) for w in workers}


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


def _decrement(counts: dict[bytes, int], h: bytes) -> None:
    n = counts.get(h, 0) - 1
    if n > 0:
        counts[h] = n
    else:
        counts.pop(h, None)
