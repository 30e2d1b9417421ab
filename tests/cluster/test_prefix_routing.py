"""Prefix-aware routing (`pdserve.cluster.prefix_routing`): the router hashes a prompt as a worker's prefix cache
does (with and without the MTP lookahead) and expects the hit the worker finds, from the cache events the worker
logs (bounded), the host tier's moves included (a host-held prefix counts, for less than a GPU-held one); and
over real model-free workers (`tests/model_free.py`), a request whose prefix a worker holds
goes there unless that worker is much busier, and a prefix evicted there stops attracting requests."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
from model_free import PAGE, FaultyHub, WorkerActor, decode_worker, prefill_worker, reference

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.prefix_routing import (
    HOST_HIT_WEIGHT,
    PrefixIndex,
    PromptHashes,
    rank_by_held,
    rank_by_prefix,
)
from pdserve.cluster.router import Router
from pdserve.engine import messages
from pdserve.engine.host_tier import HostPool
from pdserve.engine.messages import CacheEvents, PrefillPoll
from pdserve.engine.pages import PageAllocator
from pdserve.engine.prefix_cache import CacheEventLog, PrefixCache, chain_hashes
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import RankResult
from pdserve.engine.worker import prefix_cache_info

HANG_S = 10.0

# The index, without workers.


def _computed(cache: PrefixCache, allocator: PageAllocator, tokens: list[int], next_token: int):
    """A request over `tokens` whose prefill computed them all (and sampled `next_token`): its pages cached."""
    r = Request("r", tokens, SamplingParams(), Policy.PREFILL_ONLY)
    r.pages = allocator.allocate(-(-len(tokens) // PAGE))
    r.num_computed = len(tokens)
    cache.register(r, allocator, next_token)
    return r


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_router_expects_the_hit_the_worker_finds(lookahead):
    allocator, log = PageAllocator(32), CacheEventLog()
    allocator.events = log
    cache = PrefixCache(PAGE, lookahead=lookahead)
    first = list(range(1, 19))  # 18 tokens: 4 full pages
    _computed(cache, allocator, first, 99)
    index = PrefixIndex(PAGE, cache.hit_unit, lookahead)
    index.apply(CacheEvents(*log.drain([allocator])))
    assert len(index.counts) == 4 and not log
    # the next turn goes on with the sampled token; another prompt leaves the first after 16 tokens (with the
    # lookahead its 4th page's hash covers token 17, so only 3 pages match there); a short one hits nothing
    prompts = [[*first, 99, 5, 6, 7, 8], [*first[:16], 42, 43, 44, 45, 46], first[:4], [7] * 20]
    expected = [16, 12 if lookahead else 16, 0, 0]
    for prompt, hit in zip(prompts, expected, strict=True):
        asked = Request("q", prompt, SamplingParams(), Policy.PREFILL_ONLY)
        found = len(cache.match(asked, allocator, len(prompt))) * PAGE
        assert PromptHashes(prompt).hit_tokens(index) == found == hit, prompt


def test_cache_events_net_out_and_a_full_log_sends_a_bounded_snapshot():
    allocator, log = PageAllocator(8), CacheEventLog(max_hashes=3)
    allocator.events = log
    cache = PrefixCache(PAGE)
    r = _computed(cache, allocator, list(range(1, 9)), 0)  # 2 pages cached
    allocator.free(r.pages[::-1])
    allocator.allocate(8)  # both evicted: added then evicted nets out to nothing
    assert not log and log.drain([allocator]) == ([], [], False, [], [])
    allocator.free(list(range(8)))
    _computed(cache, allocator, list(range(1, 17)), 0)  # 4 pages: past the bound of 3
    events = CacheEvents(*log.drain([allocator]))
    assert events.reset and events.evicted == [] and len(events.added) == 3  # the newest 3 held now
    index = PrefixIndex(PAGE, PAGE, False, counts={b"stale": 1}, host_counts={b"stale host": 1})
    index.apply(events)
    assert b"stale" not in index.counts and len(index.counts) == 3 and not index.host_counts
    with pytest.raises(ValueError, match="max_hashes=0: must be positive"):
        CacheEventLog(0)


def test_a_full_log_snapshots_the_host_pools_too_within_its_bound():
    allocator, pool, log = PageAllocator(8), HostPool(4), CacheEventLog(max_hashes=3)
    allocator.events = pool.events = log
    _computed(PrefixCache(PAGE), allocator, list(range(1, 9)), 0)  # 2 pages cached
    pool.offload(6, b"x" * 32)
    pool.offload(5, b"y" * 32)  # 2 + 2 hashes: past the bound of 3
    events = CacheEvents(*log.drain([allocator], [pool]))
    assert events.reset and len(events.added) == 2 and events.host_added == [b"y" * 8]  # room: 1
    index = PrefixIndex(PAGE, PAGE, False, host_counts={b"stale": 1})
    index.apply(events)
    assert len(index.counts) == 2 and index.host_counts == {b"y" * 8: 1}
    pool.take([b"y" * 32])
    events = CacheEvents(*log.drain([allocator], [pool]))
    assert events == CacheEvents([], [], False, [], [b"y" * 8])  # after a reset: deltas again


def test_cache_events_of_an_earlier_format_decode_as_no_host_moves():
    """A report without the host fields (an earlier worker's) decodes with none; one with them round-trips."""
    old = msgpack.packb(
        {"failures": [], "cache_events": {"added": [b"a" * 8], "evicted": [], "reset": False}},
        use_bin_type=True,
    )
    poll = messages.decode(PrefillPoll, old)
    assert poll.cache_events == CacheEvents([b"a" * 8], [])
    assert poll.cache_events.host_added == poll.cache_events.host_evicted == []
    index = PrefixIndex(PAGE, PAGE, False)
    index.apply(poll.cache_events)
    assert index.counts == {b"a" * 8: 1} and not index.host_counts
    new = PrefillPoll([], CacheEvents([b"a" * 8], [b"b" * 8], False, [b"b" * 8], [b"a" * 8]))
    assert messages.decode(PrefillPoll, messages.encode(new)) == new


def _step_to_end(s: Scheduler, r: Request) -> None:
    """Steps `s` (every sampled token 50) until `r` finished."""
    while r.state is not RequestState.FINISHED:
        plan, _ = s.schedule()
        results = [
            RankResult(
                plan.step_id,
                [50 if row.sample is not None else None for row in step.prefill],
                [50] * len(step.decode),
            )
            for step in plan.ranks
        ]
        s.finish_step(plan, results)


@pytest.mark.parametrize("then", ["restored", "dropped"])
def test_host_moves_reach_the_index(then):
    """A worker with a host tier (one rank, 8 pages, 4 host slots): its prefix's pages evicted from the GPU
    move, in the index, from cached to host-held; restored by the next request of that prefix, back to
    cached; or let go by the host pool for newer pages, gone from both."""
    s = Scheduler(PageAllocator(8), PAGE, 64, 16, 100, 1000, {1}, prefix_caching=True, host_slots=4)
    index = PrefixIndex.from_info(prefix_cache_info(s))

    def serve(rid: str, tokens, run: bool = True) -> Request:
        r = Request(rid, list(tokens), SamplingParams(max_tokens=1), Policy.AGGREGATED)
        s.add(r)
        if run:
            _step_to_end(s, r)
        index.apply(CacheEvents(*s.cache_events.drain(s.allocators, s.host_pools)))
        return r

    prefix = list(range(3, 20))  # 17 tokens: 4 full pages
    prompt = PromptHashes([*prefix, 60, 61, 62])  # 20 tokens: a hit covers 4 pages
    serve("first", prefix)
    assert prompt.hits(index) == (16, 0) and prompt.hit_tokens(index) == 16
    serve("fill", range(30, 61))  # 8 pages: the prefix's 4 evicted to host memory
    assert prompt.hits(index) == (0, 16) and prompt.hit_tokens(index) == 16
    hashes = set(prompt.of(index))
    assert hashes <= set(index.host_counts) and not hashes & set(index.counts)
    if then == "restored":
        again = serve("again", prompt.tokens, run=False)
        assert again.num_cached_tokens == 16  # the worker found what the index said
        assert prompt.hits(index) == (16, 0) and not hashes & set(index.host_counts)
    else:
        serve("newer", range(64, 95))  # the fill's pages evicted to host: the prefix's slots reused
        assert s.host_pools[0].match(prompt.of(index)) == 0
        assert prompt.hits(index) == (0, 0) and not hashes & set(index.host_counts)
    assert len(index.host_counts) == s.host_pools[0].num_stored


def test_the_policy_counts_a_host_hit_for_less_than_a_gpu_hit():
    """A worker that holds the prompt's prefix only in its host tier attracts it over an equally loaded one
    that holds nothing, but not over one that holds it on its GPU; its hit outweighs less load."""
    prompt = PromptHashes(list(range(1, 42)))  # 40 tokens a hit can cover
    gpu, host, empty = (PrefixIndex(PAGE, PAGE, False) for _ in range(3))
    gpu.apply(CacheEvents(prompt.of(gpu), []))
    host.apply(CacheEvents([], [], host_added=prompt.of(host)))
    assert (prompt.hits(gpu), prompt.hits(host), prompt.hits(empty)) == ((40, 0), (0, 40), (0, 0))
    workers = {"gpu": gpu, "host": host, "empty": empty}

    def best(names: list[str], load: dict[str, int], **kw) -> str:
        ranked, hits = rank_by_prefix(
            names, prompt, lambda w: load.get(w, 0), 1.0, workers.get, **kw
        )
        assert hits == {w: 0 if w == "empty" else 40 for w in names}  # tokens not computed there
        return ranked[0]

    assert HOST_HIT_WEIGHT == RouterConfig().prefix_host_hit_weight == 0.75
    assert best(["empty", "host"], {}) == "host"
    assert best(["host", "gpu"], {}) == "gpu"
    assert best(["host", "gpu"], {}, host_weight=1.0) == "host"  # a tie: the given order
    # 40 host tokens count as 30: more than 29 queued tokens, less than 31; 40 GPU tokens outweigh 31
    assert best(["empty", "host"], {"host": 29}) == "host"
    assert best(["empty", "host"], {"host": 31}) == "empty"
    assert best(["empty", "gpu"], {"gpu": 31}) == "gpu"
    # a host tail after a GPU hit: the pages after the GPU's in the host tier count
    both = workers["both"] = PrefixIndex(PAGE, PAGE, False)
    both.apply(CacheEvents(prompt.of(both)[:2], [], host_added=prompt.of(both)[2:]))
    assert prompt.hits(both) == (8, 32)
    assert best(["gpu", "both"], {}) == "gpu" and best(["host", "both"], {}) == "both"
    with pytest.raises(ValueError, match=r"prefix_host_hit_weight=1.5: must be in \[0, 1\]"):
        RouterConfig(prefix_host_hit_weight=1.5)


def test_the_policy_weighs_the_hit_against_the_load():
    index = PrefixIndex(PAGE, PAGE, False)
    prompt = list(range(1, 42))  # 40 tokens a hit can cover
    index.apply(CacheEvents(PromptHashes(prompt).of(index), []))
    workers = {"holder": index, "other": PrefixIndex(PAGE, PAGE, False)}
    for holder_load, weight, best in [(0, 1.0, "holder"), (39, 1.0, "holder"), (41, 1.0, "other"),
                                      (5, 10.0, "other"), (1000, 0.0, "holder")]:  # fmt: skip
        load = {"holder": holder_load, "other": 0}
        ranked, hits = rank_by_prefix(workers, PromptHashes(prompt), load.get, weight, workers.get)
        assert ranked[0] == best and hits == {"holder": 40, "other": 0}


def test_decode_workers_rank_by_held_pages_and_room():
    """A decode worker that keeps received KV holds every full page within the first n - 1 tokens (no hit
    unit); weight 1 picks the most room after the request, weight 0 the most pages held."""
    prompt = list(range(1, 19))  # 18 tokens: 4 pages a decode worker may hold
    holder = PrefixIndex(PAGE, 16, lookahead=False, reuse_held=True)
    holder.expect(PromptHashes(prompt).of(holder), time.monotonic())
    # a worker that keeps no received KV holds nothing for transfers
    plain = PrefixIndex(PAGE, 16, lookahead=False)
    plain.expect(PromptHashes(prompt).of(plain), time.monotonic())
    assert PromptHashes(prompt).held_pages(holder) == 4
    assert PromptHashes(prompt).held_pages(plain) == PromptHashes(prompt).held_pages(None) == 0
    index = {"holder": holder, "plain": plain, "none": None}
    for holder_free, weight, best in [(20, 1.0, "holder"), (15, 1.0, "plain"), (1, 0.0, "holder")]:
        free = {"holder": holder_free, "plain": 20, "none": 18}
        ranked, held = rank_by_held(
            ["plain", "none", "holder"], PromptHashes(prompt), free.get, lambda d: 0, weight,
            index.get,
        )  # fmt: skip
        assert ranked[0] == best and held == {"holder": 4, "plain": 0, "none": 0}, holder_free
    ranked, _ = rank_by_held(["plain", "none"], PromptHashes(prompt), free.get, len, 1.0, index.get)
    assert ranked == ["plain", "none"]  # nothing held anywhere: the given order


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_the_router_expects_the_pages_a_decode_worker_holds(batch_invariant):
    """A decode worker's received KV, by its cache events: the router's expected held pages are those the
    worker reserves for the next turn (in batch-invariant mode its chains hang off another root)."""
    s = Scheduler(
        PageAllocator(32), PAGE, 64, 8, 100, 1000, {1}, fixed_chunks=batch_invariant,
        prefix_caching=True, reuse_held=True,
    )  # fmt: skip
    first = Request("a", list(range(3, 21)), SamplingParams(max_tokens=1), Policy.DECODE_ONLY)
    s.add(first)
    s.kv_arrived(first.transfer_id, 18, 50)  # finishes at once (max_tokens=1)
    index = PrefixIndex.from_info(prefix_cache_info(s))
    assert index.reuse_held and (index.held_root != b"") == batch_invariant
    index.apply(CacheEvents(*s.cache_events.drain(s.allocators)))
    prompt = [*first.token_ids, 60, 61, 62]
    after = Request("b", prompt, SamplingParams(max_tokens=1), Policy.DECODE_ONLY)
    s.add(after)
    assert PromptHashes(prompt).held_pages(index) == after.num_held_pages == 4


# Over real workers.


class Cluster:
    """A router over model-free workers: `decodes` aggregated decode workers (d0, d1), or one decode worker
    fed by `prefills` prefill workers (p0, p1); the prefix cache on everywhere (and a host tier of `host_slots`
    pages on the decode workers)."""

    def __init__(
        self, decodes: int = 2, prefills: int = 0, pages: int = 24, host_slots: int = 0, **router
    ):
        self.hub = FaultyHub() if prefills else None
        self.router = Router(
            RouterConfig(poll_timeout_s=0.02, admission_timeout_s=HANG_S, **router)
        )
        workers = [prefill_worker(self.hub, f"p{i}", num_pages=pages) for i in range(prefills)]
        workers += [
            decode_worker(self.hub, f"d{i}", num_pages=pages, host_slots=host_slots)
            for i in range(decodes)
        ]
        self.actors = {w.worker_id: WorkerActor(w, self.hub) for w in workers}
        self.handles: dict[str, WorkerHandle] = {}

    def start(self) -> None:
        for worker_id, actor in self.actors.items():
            role = PREFILL if worker_id.startswith("p") else DECODE
            w = WorkerHandle(worker_id, role, actor, None, 0, WorkerState.SERVING)
            w.num_pages, w.page_size = actor.worker.num_pages, PAGE
            w.prefix = PrefixIndex.from_info(prefix_cache_info(actor.worker.scheduler))
            self.handles[worker_id] = w
            self.router.add_worker(w)

    async def serve(self, prompt: list[int], on: str | None = None) -> tuple[str, int]:
        """Runs a request to its end (pinned to aggregated worker `on` where given): (the worker that computed
        its prompt, its cached tokens). Waits until that worker's cache events of it reached the router."""
        force = None if on is None else (None, self.handles[on])
        r = self.router.open("c", prompt, SamplingParams(max_tokens=3, seed=1), None)
        tokens = []
        try:
            while (out := await self.router.next_tokens(r, force)) is not None:
                tokens += out.token_ids
        finally:
            self.router.close(r)
        assert tokens == reference(prompt, 3)
        where = r.prefill_worker or r.decode_worker
        w, worker = self.handles[where], self.actors[where].worker
        give_up = time.monotonic() + HANG_S
        while worker.scheduler.cache_events or not w.prefix.counts:
            assert time.monotonic() < give_up, f"{where}'s cache events did not arrive"
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # its poll under way lands
        return where, r.num_cached_tokens or 0

    async def close(self) -> None:
        await self.router.close_all()
        for actor in self.actors.values():
            actor.stop()


def run(test, **cluster):
    async def main():
        c = Cluster(**cluster)
        c.start()
        try:
            await asyncio.wait_for(test(c), 30)
        finally:
            await c.close()

    asyncio.run(main())


PROMPT = list(range(1, 30))  # 7 full pages a hit can cover


@pytest.mark.timed
@pytest.mark.parametrize("prefills", [0, 2])
def test_a_shared_prefix_goes_where_it_is_cached_unless_that_worker_is_much_busier(prefills):
    async def test(c: Cluster):
        first, cached = await c.serve(PROMPT)
        assert cached == 0
        other = next(
            w
            for w in c.handles.values()
            if w.worker_id != first and w.role == c.handles[first].role
        )
        # the load-only choice would be the other worker now (fewer queued tokens; more free pages)
        c.handles[first].queued_tokens = 20
        where, cached = await c.serve([*PROMPT, 50, 51, 52, 53])
        assert (where, cached) == (first, 28)
        # much busier: more queued tokens than the hit saves
        c.handles[first].queued_tokens = 40
        where, cached = await c.serve([*PROMPT, 60, 61])
        assert (where, cached) == (other.worker_id, 0)

    run(test, decodes=1 if prefills else 2, prefills=prefills)


@pytest.mark.timed
def test_load_only_routing_ignores_the_cache():
    async def test(c: Cluster):
        first, _ = await c.serve(PROMPT)
        c.handles[first].queued_tokens = 1
        where, cached = await c.serve([*PROMPT, 50])
        assert where != first and cached == 0

    run(test, prefix_aware_routing=False)


@pytest.mark.timed
def test_an_evicted_prefix_stops_attracting_requests():
    async def test(c: Cluster):
        first, _ = await c.serve(PROMPT)
        c.handles[first].queued_tokens = 4  # a little busier: the hit decides
        assert (await c.serve([*PROMPT, 50]))[0] == first
        held = set(c.handles[first].prefix.counts)
        for i in range(
            3
        ):  # other prompts on the same worker, filling its cache: PROMPT's pages evicted
            await c.serve([40 + i] * 60, on=first)
        assert not held & set(c.handles[first].prefix.counts)
        pages = chain_hashes(PROMPT, PAGE, 7, lookahead=False)
        assert (
            c.actors[first].worker.scheduler.allocator.match(pages) == []
        )  # the worker's cache agrees
        where, cached = await c.serve([*PROMPT, 51])
        assert where != first and cached == 0

    run(test)


@pytest.mark.timed
@pytest.mark.parametrize("host_weight", [0.75, 0.0])
def test_a_prefix_evicted_to_host_memory_still_attracts_requests(host_weight):
    """With a host tier, the prefix's pages evicted from the worker's GPU go to its host memory, the events say
    so, and (the worker a little busier than the other) the next request of that prefix goes there and is
    restored, its tokens those of the prompt computed whole; with the host hit weighed 0 it goes by load to the
    other worker, which computes it all."""

    async def test(c: Cluster):
        first, _ = await c.serve(PROMPT)
        hashes = set(PromptHashes(PROMPT).of(c.handles[first].prefix))
        # other prompts on the same worker: PROMPT's pages evicted to host memory
        for i in range(3):
            await c.serve([40 + i] * 60, on=first)
        index, pool = c.handles[first].prefix, c.actors[first].worker.scheduler.host_pools[0]
        assert not hashes & set(index.counts) and hashes <= set(index.host_counts)
        assert pool.match(chain_hashes(PROMPT, PAGE, 7, lookahead=False)) == 7  # the worker agrees
        for w in c.handles.values():
            w.reserved_pages = 0  # as the workers' stats would say: nothing runs
        c.handles[first].queued_tokens = 4  # a little busier: the host hit decides
        where, cached = await c.serve([*PROMPT, 50])
        if host_weight:
            assert (where, cached) == (first, 28) and pool.num_restored >= 7
            assert hashes <= set(index.counts) and not hashes & set(index.host_counts)
        else:
            assert where != first and cached == 0

    run(test, host_slots=64, prefix_host_hit_weight=host_weight)


@pytest.mark.timed
def test_a_burst_sharing_a_new_prefix_goes_where_the_first_was_placed():
    """The second prompt is placed while the first is still prefilling (its worker held), before any cache
    event: its pages count as there from the first's placement."""

    async def test(c: Cluster):
        d0, gate = c.actors["d0"].worker, threading.Event()
        d0.runner.on_execute = lambda plan: gate.wait(HANG_S)
        params = SamplingParams(max_tokens=2, seed=1)
        first = c.router.open("a", PROMPT, params, None)
        second = c.router.open("b", [*PROMPT, 50, 51, 52, 53], params, None)
        tasks = [asyncio.create_task(c.router.next_tokens(r)) for r in (first, second)]
        try:
            give_up = time.monotonic() + HANG_S
            while not (first.decode and second.decode):
                assert time.monotonic() < give_up, "the requests were not placed"
                await asyncio.sleep(0.002)
            assert not c.handles["d0"].prefix.counts  # no event came: only the placement tells
            assert (first.decode_worker, second.decode_worker) == ("d0", "d0")
        finally:
            gate.set()
        await asyncio.gather(*tasks)
        for r in (first, second):
            c.router.close(r)

    run(test, prefix_load_weight=0.5)


@pytest.mark.timed
def test_the_next_turn_goes_to_the_decode_worker_holding_the_last_and_only_its_missing_pages_travel():
    """Disaggregated (p0 feeding d0 and d1): the second turn of a conversation goes to the decode worker that
    holds the first (a little busier than the other) and p0 sends only the pages it lacks; much busier, the
    other one gets the turn, and all its pages; an index that wrongly expects pages there costs pages sent,
    never a token."""

    async def turn(c: Cluster, prompt: list[int]):
        r = c.router.open("c", prompt, SamplingParams(max_tokens=3, seed=1), None)
        tokens = []
        try:
            while (out := await c.router.next_tokens(r)) is not None:
                tokens += out.token_ids
        finally:
            c.router.close(r)
        assert tokens == reference(prompt, 3)
        return r, tokens

    async def test(c: Cluster):
        p0 = c.actors["p0"].worker
        first, answer = await turn(c, PROMPT)
        d = first.decode_worker
        other = "d1" if d == "d0" else "d0"
        give_up = time.monotonic() + HANG_S
        while c.actors[d].worker.scheduler.cache_events:
            assert time.monotonic() < give_up, f"{d}'s cache events did not arrive"
            await asyncio.sleep(0.002)
        second = [*PROMPT, *answer, 50, 51]  # 34 tokens: 9 pages, the first 7 held on d
        for w in c.handles.values():
            w.reserved_pages = 0  # as the workers' stats would say: nothing runs
        c.handles[d].reserved_pages = 4  # the load-only choice is the other worker
        r, _ = await turn(c, second)
        assert r.decode_worker == d and p0.stats().kv_pages_not_sent == 7
        sent = p0.stats().kv_pages_sent
        assert sent == 8 + 2
        c.handles[d].reserved_pages = 10  # much busier: more than the 7 held pages save
        r, _ = await turn(c, [*second, 60])
        assert r.decode_worker == other and p0.stats().kv_pages_sent == sent + 9
        # the router expects the other worker to hold a prompt it has never seen: it goes there, whole
        fresh = [9] * 30  # 8 pages, 7 of which a decode worker could hold
        w = c.handles[other]
        w.prefix.expect(PromptHashes(fresh).of(w.prefix), time.monotonic())
        not_sent = p0.stats().kv_pages_not_sent
        c.handles[d].reserved_pages, w.reserved_pages = 0, 4  # load alone: d
        r, _ = await turn(c, fresh)
        assert r.decode_worker == other and p0.stats().kv_pages_not_sent == not_sent

    run(test, decodes=2, prefills=1, pages=32)
