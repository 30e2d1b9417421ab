"""The prefix cache without a model: the allocator's reference counts, cached pages and least-recently-released
eviction; the scheduler's hits (full pages, the last token left to compute, the hit cut to chunk multiples in
batch-invariant mode, the next token in the hash where the worker runs MTP), what they report, and what a
cancelled, failed or preempted request leaves; and a stress run of 10,000 requests with random shared prefixes,
cancels (some while their step runs), preemptions and evictions over a fake model whose every sample depends on
the KV its pages hold, after which every page is free or cached and unreferenced; and one of decode-only
requests on a decode worker that keeps received KV, their transfers carrying only the pages it does not hold."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.pages import PageAllocator
from pdserve.engine.prefix_cache import PrefixCache, page_hash
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.sampling_params import FinishReason, SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import RankResult, StepPlan
from pdserve.model.errors import CapacityError

PAGE = 4


def test_shared_pages_are_counted_and_cached_ones_evicted_least_recently_released_first():
    a = PageAllocator(6)
    x, y = a.allocate(2), a.allocate(2)  # [0, 1], [2, 3]
    assert a.cache(x[0], b"x0") and a.cache(x[1], b"x1") and a.cache(y[0], b"y0")
    assert not a.cache(y[1], b"x1")  # another page has these contents: the first stays
    assert a.match([b"x0", b"x1", b"zz", b"y0"]) == [0, 1]  # the leading run only
    a.take([0, 1])  # a second holder
    a.free(x)
    assert (a.num_used, a.num_free) == (4, 2)  # still referenced once
    a.free([0, 1])
    a.free(y)  # page 2 cached: kept; page 3 not: free
    assert (a.num_used, a.num_free, a.num_cached) == (0, 6, 3)
    a.take(a.match([b"y0"]))  # page 2 referenced again, no longer evictable
    assert a.cost([0, 1, 2]) == 2
    assert a.allocate(3) == [3, 4, 5]  # the free pages first: nothing evicted
    assert a.allocate(1) == [0] and a.num_evicted == 1  # then page 0, released before page 1
    assert a.match([b"x0"]) == [] and a.match([b"x1"]) == [1]
    with pytest.raises(CapacityError, match="need 2 KV pages, 1 free of 6"):
        a.allocate(2)
    a.check()


def test_cached_pages_are_not_held_back_during_a_pass_and_misuse_raises():
    a = PageAllocator(2)
    pages = a.allocate(2)
    a.cache(pages[0], b"p")
    a.hold_frees()
    a.free(pages)
    assert a.num_free == 1  # the cached page: nothing writes it; the other waits for the pass
    a.check()
    a.release_held()
    assert a.num_free == 2
    with pytest.raises(AssertionError, match="page 1 cached but not referenced"):
        a.cache(1, b"q")
    with pytest.raises(AssertionError, match="page 0 freed but not allocated"):
        a.free([0])


def test_hashes_chain_through_parents():
    assert page_hash(b"", [1, 2]) != page_hash(b"", [2, 1])
    assert page_hash(page_hash(b"", [1, 2]), [3, 4]) != page_hash(page_hash(b"", [9, 9]), [3, 4])
    with pytest.raises(ValueError, match="align=0"):
        PrefixCache(PAGE, align=0)
    # a request's chain, made a piece at a time, is the chain of its pages (with lookahead: and the token after)
    tokens = list(range(10, 33))
    for lookahead in (False, True):
        r = request("r", tokens)
        cache, allocator = PrefixCache(PAGE, lookahead), PageAllocator(8)
        cache.match(r, allocator, 9)  # 2 pages
        cache.match(r, allocator, len(tokens))  # 5 pages
        want, parent = [], b""
        for p in range(5):
            parent = page_hash(parent, tokens[p * PAGE : (p + 1) * PAGE + lookahead])
            want.append(parent)
        assert r.page_hashes == want


def aggregated(num_pages=32, budget=64, chunk=16, **kw) -> Scheduler:
    return Scheduler(
        PageAllocator(num_pages), PAGE, budget, chunk, 100, 1000, {1}, max_running=8,
        worker_kind="decode worker", prefix_caching=True, **kw,
    )  # fmt: skip


def request(rid, prompt, max_tokens=2, policy=Policy.AGGREGATED) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, seed=0), policy)


def run(s: Scheduler, token=20, results=None) -> list:
    """One step, every sampling row sampling `token`; returns its outputs."""
    plan, outputs = s.schedule()
    if plan is None:
        return outputs
    rank = plan.ranks[0]
    result = results or RankResult(
        plan.step_id,
        [token if row.sample is not None else None for row in rank.prefill],
        [token] * len(rank.decode),
    )
    return outputs + s.finish_step(plan, [result]).outputs


def drain(s: Scheduler) -> list:
    outputs = []
    for _ in range(100):
        if not s.requests:
            return outputs
        outputs += run(s)
    raise AssertionError("requests left")


def test_a_prompt_prefilled_before_starts_after_its_full_pages_and_reports_them():
    s = aggregated()
    prompt = list(range(10, 24))  # 14 tokens: pages 0-2 full
    s.add(request("a", prompt))
    first = drain(s)
    assert first[0].num_cached_tokens == 0
    assert s.allocator.num_cached == 3 and s.allocator.num_used == 0
    again, longer, exact = (
        request("b", prompt), request("c", prompt + [7, 8]), request("d", prompt[:12])
    )  # fmt: skip
    for r in (again, longer, exact):
        s.add(r)
    # b, c: 12 cached tokens; d (3 full pages): the last token is computed again, so its last page
    assert [r.num_computed for r in (again, longer, exact)] == [12, 12, 8]
    assert again.pages[:3] == longer.pages[:3] and s.allocator.num_used == 3 + 1 + 1 + 1
    plan, _ = s.schedule()
    assert [(row.request_id, row.start, len(row.token_ids)) for row in plan.ranks[0].prefill] == [
        ("b", 12, 2), ("c", 12, 4), ("d", 8, 4),
    ]  # fmt: skip
    outputs = s.finish_step(plan, [RankResult(plan.step_id, [20, 20, 20])]).outputs
    assert [o.num_cached_tokens for o in outputs] == [12, 12, 8]
    assert [o.num_cached_tokens for o in drain(s)] == [None] * 3  # once per request
    assert (s.prefix_cache.num_queries, s.prefix_cache.num_hits) == (14 + 14 + 16 + 12, 32)
    assert s.allocator.num_used == 0
    s.allocator.check()


def test_a_finished_request_s_last_pages_are_evicted_first():
    s = aggregated(num_pages=7)
    prompt = list(range(10, 27))  # 17 tokens: 4 full pages cached
    s.add(request("a", prompt, max_tokens=1))
    drain(s)
    assert s.allocator.num_cached == 4
    s.add(request("b", list(range(50, 63)), max_tokens=1))  # 4 pages: the 3 free and 1 evicted
    assert s.allocator.num_evicted == 1
    drain(s)
    s.add(request("c", prompt))  # finds the first 3 pages: the one evicted was the last
    assert s.requests["c"].num_computed == 12


def test_a_cancelled_or_failed_request_releases_its_references_and_the_pages_stay_cached():
    s = aggregated()
    prompt = list(range(10, 30))
    s.add(request("a", prompt))
    drain(s)
    s.add(request("b", prompt))
    s.add(request("c", prompt))
    plan, _ = s.schedule()
    s.abort("b")  # while its step runs
    rank = plan.ranks[0]
    failed = RankResult(plan.step_id, prefill_error="boom")
    outputs = s.finish_step(plan, [failed]).outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("c", FinishReason.ABORT)]
    assert len(rank.prefill) == 2 and s.allocator.num_used == 0 and s.allocator.num_cached == 5
    s.allocator.check()


def test_a_preempted_request_leaves_its_pages_cached_and_finds_them_again():
    s = aggregated(num_pages=10)
    old, new = request("old", range(10, 26), max_tokens=12), request("new", range(40, 52), 12)
    s.add(old)
    s.add(new)
    while not s.num_preemptions:  # both grow until old needs a page nobody has free
        run(s)
    assert new.state is RequestState.WAITING and new.num_cached_pages == 0
    assert len(s.allocator.match(new.page_hashes)) == 3  # its prompt's pages stay cached
    s.allocator.check()
    run(s)
    assert new.state is RequestState.WAITING  # no room yet: it waits
    while new.state is RequestState.WAITING:
        run(s)
    assert new.num_computed > 0  # found what it had cached, or what it generated before
    drain(s)
    s.allocator.check()
    assert s.allocator.num_used == 0


def test_batch_invariant_hits_are_whole_chunks():
    s = aggregated(chunk=8, fixed_chunks=True)
    prompt = list(range(10, 30))  # 20 tokens
    s.add(request("a", prompt))
    drain(s)
    b = request("b", prompt)
    s.add(b)
    assert b.num_computed == 16  # 4 full pages within 19 tokens, 16 a multiple of 8
    s.add(request("c", prompt[:15]))
    assert s.requests["c"].num_computed == 8  # 3 full pages within 14 tokens: cut to 8
    s.add(request("d", prompt[:14] + [99] * 6))
    assert s.requests["d"].num_computed == 8  # 3 pages found (page 3 differs): cut to 8


def test_with_mtp_a_page_is_found_only_where_the_next_token_is_the_same():
    """The MTP layer's row at a page's last position was made with the token after the page."""
    s = aggregated(num_drafts=1)
    prompt = list(range(10, 22))  # 12 tokens: 3 full pages
    s.add(request("a", prompt))
    run(s, token=50)  # prefilled; sampled 50: page 2's next token is known, all 3 cached
    assert s.allocator.num_cached == 3
    same, other = request("b", prompt[:8] + [18, 99]), request("c", prompt[:8] + [77, 99])
    s.add(same)
    s.add(other)
    assert (same.num_computed, other.num_computed) == (8, 4)
    s.add(request("d", prompt + [50, 60]))  # goes on with the token a's prefill sampled
    assert s.requests["d"].num_computed == 12


def test_off_by_default_in_the_scheduler():
    s = Scheduler(PageAllocator(16), PAGE, 64, 16, 100, 1000, {1})
    prompt = list(range(10, 30))
    for rid in ("a", "b"):
        s.add(request(rid, prompt))
        drain(s)
    assert s.prefix_cache is None and s.allocator.num_cached == 0


# The stress run.


VOCAB = 50


def next_token(values) -> int:
    """What the fake model samples after a sequence whose KV rows hold `values`: a hash of them all."""
    h = 17
    for v in values:
        h = (h * 31 + v) % 1_000_003
    return 2 + h % (VOCAB - 2)


class ListRunner:
    """A fake model over a list cache (one list of rows per page): each row it runs writes its token + 1, and it
    samples `next_token` of the rows its pages hold up to the row. A request that found another's page
    holding other contents, or whose shared page another request wrote, samples other tokens than `expected`.
    One such cache per rank (data-parallel attention: each rank its own pages)."""

    def __init__(self, num_pages: int, ranks: int = 1):
        self.caches = [[[0] * PAGE for _ in range(num_pages)] for _ in range(ranks)]

    def run(self, plan: StepPlan) -> list[RankResult]:
        return [self._run_rank(plan, rank) for rank in range(len(self.caches))]

    def _run_rank(self, plan: StepPlan, rank: int) -> RankResult:
        step, result = plan.ranks[rank], RankResult(plan.step_id)
        self.cache = self.caches[rank]
        for row in step.prefill:
            for i, t in enumerate(row.token_ids):
                self._write(row.page_ids, row.start + i, t)
            end = row.start + len(row.token_ids)
            result.prefill_tokens.append(None if row.sample is None else self._sample(row, end))
        for row in step.decode:
            self._write(row.page_ids, row.position, row.token_id)
            result.decode_tokens.append(self._sample(row, row.position + 1))
        return result

    def _write(self, pages: list[int], position: int, token: int) -> None:
        self.cache[pages[position // PAGE]][position % PAGE] = token + 1

    def _sample(self, row, end: int) -> int:
        values = [v for p in row.page_ids[: -(-end // PAGE)] for v in self.cache[p]][:end]
        return next_token(values)


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token([t + 1 for t in seq]))
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "policy, total, fixed_chunks, ranks",
    [
        (Policy.AGGREGATED, 10_000, False, 1),
        (Policy.AGGREGATED, 2_000, True, 1),  # batch-invariant mode: hits of whole chunks
        (Policy.PREFILL_ONLY, 2_000, False, 1),  # a prefill worker: pages kept while the KV is sent
        (Policy.AGGREGATED, 2_000, False, 2),  # data-parallel attention: a cache per rank
    ],
)
def test_requests_with_shared_prefixes_cancels_and_evictions_leak_nothing(
    policy, total, fixed_chunks, ranks
):
    rng = random.Random(total + ranks)
    num_pages = 48 // ranks
    s = Scheduler(
        [PageAllocator(num_pages) for _ in range(ranks)], PAGE, 48, 16 if fixed_chunks else 10,
        VOCAB, 1000, {0}, max_running=12, fixed_chunks=fixed_chunks, worker_kind="worker",
        prefix_caching=True,
    )  # fmt: skip
    runner = ListRunner(num_pages, ranks)
    # prefixes made of a few page-long blocks: the same page contents come after different parents
    blocks = [[rng.randrange(2, VOCAB) for _ in range(PAGE)] for _ in range(4)]
    prefixes = [
        [t for _ in range(rng.randrange(1, 9)) for t in rng.choice(blocks)] for _ in range(20)
    ]  # fmt: skip
    got: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    sending: list[str] = []  # prefill-only requests whose KV is being sent
    finished = cancelled = 0
    submitted = steps = 0
    pending: Request | None = None
    while submitted < total or s.requests:
        while submitted < total and len(s.requests) < 12:
            if pending is None:
                prompt = rng.choice(prefixes) + [
                    rng.randrange(2, VOCAB) for _ in range(rng.randrange(6))
                ]
                params = SamplingParams(max_tokens=rng.randrange(1, 4), seed=0)
                pending = Request(f"r{submitted}", prompt, params, policy)
            try:
                s.add(pending)
            except CapacityError:
                break  # full now: it waits (the router's admission queue)
            prompts[pending.request_id], got[pending.request_id] = list(pending.token_ids), []
            pending, submitted = None, submitted + 1
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(list(s.requests)))
            cancelled += 1
        while sending and rng.random() < 0.5:  # a send acknowledged
            s.release(sending.pop(rng.randrange(len(sending))))
            finished += 1
        plan, outputs = s.schedule()
        steps += 1
        if plan is not None:
            if rng.random() < 0.05 and s.requests:  # a cancel while the step runs
                s.abort(rng.choice(list(s.requests)))
                cancelled += 1
            outcome = s.finish_step(plan, runner.run(plan))
            outputs += outcome.outputs
            for request, token, _ in outcome.to_send:
                assert [token] == expected(prompts[request.request_id], 1), request.request_id
                sending.append(request.request_id)
        for out in outputs:
            got[out.request_id] += out.token_ids
            if out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                finished += 1
                prompt, tokens = prompts[out.request_id], got[out.request_id]
                assert tokens == expected(prompt, len(tokens)), out.request_id
        sending = [rid for rid in sending if rid in s.requests]  # those not cancelled
        assert steps < 20 * total, "no progress"
    for a in s.allocators:
        a.check()
        assert a.num_used == 0 and a.num_free == num_pages
        assert a.num_evicted > total // 100 // ranks  # the cache ran full
    assert finished > total // 2 and cancelled > total // 100
    assert s.prefix_cache.num_hits > s.prefix_cache.num_queries // 8  # the prefixes were found
    assert s.num_preemptions > 0 or policy is Policy.PREFILL_ONLY


@pytest.mark.parametrize(
    "fixed_chunks, ranks",
    [(False, 1), (True, 1), (False, 2)],
    ids=["default", "batch-invariant", "dp2"],
)
def test_decode_only_requests_on_held_pages_cancels_and_failures_leak_nothing(fixed_chunks, ranks):
    """A decode worker that keeps received KV (`reuse_held`): 1,000 decode-only requests with random shared
    prefixes, their KV delivered (into the pages after those held, as a prefill worker sends it) or failed at
    random, cancels (some while a step runs), evictions: every stream samples what its prompt gives, so a held
    page always held the rows of its tokens, and every page ends free or cached and unreferenced."""
    rng = random.Random(7 + ranks + fixed_chunks)
    total, num_pages = 1_000, 48 // ranks
    s = Scheduler(
        [PageAllocator(num_pages) for _ in range(ranks)], PAGE, 48, 16, VOCAB, 1000, {0},
        max_running=12, fixed_chunks=fixed_chunks, worker_kind="decode worker", prefix_caching=True,
        reuse_held=True,
    )  # fmt: skip
    runner = ListRunner(num_pages, ranks)
    blocks = [[rng.randrange(2, VOCAB) for _ in range(PAGE)] for _ in range(4)]
    prefixes = [
        [t for _ in range(rng.randrange(1, 9)) for t in rng.choice(blocks)] for _ in range(20)
    ]  # fmt: skip
    got: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    finished = failed = cancelled = submitted = steps = 0
    while submitted < total or s.requests:
        while submitted < total and len(s.requests) < 12:
            prompt = rng.choice(prefixes) + [
                rng.randrange(2, VOCAB) for _ in range(rng.randrange(6))
            ]
            params = SamplingParams(max_tokens=rng.randrange(1, 4), seed=0)
            request = Request(f"r{submitted}", prompt, params, Policy.DECODE_ONLY)
            try:
                s.add(request)
            except CapacityError:
                break  # full now: the router tries again later
            held = request.num_held_pages
            assert held <= (len(prompt) - 1) // PAGE
            prompts[request.request_id], got[request.request_id] = list(prompt), []
            submitted += 1
        outputs = []
        for request in [r for r in s.requests.values() if r.state is RequestState.WAITING_FOR_KV]:
            roll = rng.random()
            if roll < 0.03:
                outputs += s.kv_failed(request.transfer_id, "the transfer failed")
                failed += 1
            elif roll < 0.6:  # the pages after the held ones arrive, with the first token
                cache, prompt = runner.caches[request.rank], prompts[request.request_id]
                for position in range(request.num_held_pages * PAGE, len(prompt)):
                    cache[request.pages[position // PAGE]][position % PAGE] = prompt[position] + 1
                first = expected(prompt, 1)[0]
                outputs += s.kv_arrived(request.transfer_id, len(prompt), first)
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(list(s.requests)))
            cancelled += 1
        plan, planned = s.schedule()
        outputs += planned
        steps += 1
        if plan is not None:
            if rng.random() < 0.05 and s.requests:
                s.abort(rng.choice(list(s.requests)))
                cancelled += 1
            outputs += s.finish_step(plan, runner.run(plan)).outputs
        for out in outputs:
            got[out.request_id] += out.token_ids
            if out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                finished += 1
                prompt, tokens = prompts[out.request_id], got[out.request_id]
                assert tokens == expected(prompt, len(tokens)), out.request_id
        assert steps < 50 * total, "no progress"
    for a in s.allocators:
        a.check()
        assert a.num_used == 0 and a.num_free == num_pages
        assert a.num_evicted > 0  # the cache ran full
    assert finished > total // 2 and cancelled > total // 100 and failed > 0
    assert s.num_held_pages > total // 2  # the prefixes were held
