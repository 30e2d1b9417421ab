"""The host tier without a model: the host pool's slots (stored least recently first, held while a restore
reads them), copies batched into runs in decision order, a prompt that goes on past its GPU hit into pages the
host pool stores starting after them; and a stress run with random shared prefixes, cancels, preemptions and
evictions to the host pool and back, over a fake model whose samples depend on the KV its pages hold, after
which no page and no host slot is leaked."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.host_tier import OFFLOAD, RESTORE, HostCopy, HostPool, copy_runs
from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request
from pdserve.engine.sampling_params import FinishReason, SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import RankResult, StepPlan
from pdserve.model.errors import CapacityError

from .test_prefix_cache import PAGE, VOCAB, ListRunner, expected


def test_the_pool_stores_least_recently_stored_first_and_holds_slots_read_by_a_restore():
    pool = HostPool(2)
    pool.offload(5, b"a")
    pool.offload(6, b"b")
    pool.offload(9, b"a")  # stored already: found again, nothing copied
    pool.offload(7, b"c")  # full: b goes, the least recently stored
    assert pool.match([b"a", b"c", b"b"]) == 2 and pool.match([b"b"]) == 0
    assert pool.pending() == [
        HostCopy(OFFLOAD, 5, 0),
        HostCopy(OFFLOAD, 6, 1),
        HostCopy(OFFLOAD, 7, 1),
    ]
    slots = pool.take([b"a"])
    pool.restore(slots[0], 3)
    pool.offload(8, b"d")  # slot 0 is read by the restore: c's slot is reused
    pool.check()
    copies, held = pool.take_copies()
    assert copies[-2:] == [HostCopy(RESTORE, 3, 0), HostCopy(OFFLOAD, 8, 1)] and held == [0]
    pool.offload(2, b"e"), pool.offload(4, b"f")  # d stays: e replaces it; f: every slot busy
    assert pool.num_dropped == 0 and pool.match([b"f"]) == 1 and pool.match([b"d"]) == 0
    pool.check(in_flight=held)
    pool.release(held)
    pool.check()
    with pytest.raises(ValueError, match="num_slots=0"):
        HostPool(0)


def test_copies_are_batched_into_runs_of_consecutive_pages_and_slots_in_order():
    copies = [HostCopy(OFFLOAD, p, s) for p, s in ((4, 0), (5, 1), (6, 2), (9, 3))]
    copies += [HostCopy(RESTORE, 7, 4), HostCopy(RESTORE, 8, 5), HostCopy(OFFLOAD, 10, 6)]
    assert copy_runs(copies) == [
        (OFFLOAD, 4, 0, 3), (OFFLOAD, 9, 3, 1), (RESTORE, 7, 4, 2), (OFFLOAD, 10, 6, 1),
    ]  # fmt: skip


class HostListRunner(ListRunner):
    """`ListRunner` with a host pool of lists: a plan's copies run, in order, before its passes."""

    def __init__(self, num_pages: int, num_slots: int, ranks: int = 1):
        super().__init__(num_pages, ranks)
        self.hosts = [[[0] * PAGE for _ in range(num_slots)] for _ in range(ranks)]

    allocators: list[PageAllocator] = []
    """Where given, a row that writes a cached page fails (the host tier's copies overlap a step on
    the premise that none does)."""

    def run(self, plan: StepPlan) -> list[RankResult]:
        for rank, copies in enumerate(plan.host_copies):
            self.copy(rank, copies)
        return super().run(plan)

    def _run_rank(self, plan: StepPlan, rank: int) -> RankResult:
        self._cached = self.allocators[rank]._hash_of if self.allocators else {}
        return super()._run_rank(plan, rank)

    def _write(self, pages: list[int], position: int, token: int) -> None:
        assert pages[position // PAGE] not in self._cached, "a cached page written"
        super()._write(pages, position, token)

    def copy(self, rank: int, copies: list[HostCopy]) -> None:
        """Runs copies at once (`Scheduler.issue_host_copies`, as a CPU worker's store does)."""
        for c in copies:
            cache, host = self.caches[rank], self.hosts[rank]
            if c.kind == OFFLOAD:
                host[c.slot] = list(cache[c.page])
            else:
                cache[c.page] = list(host[c.slot])


def step(s: Scheduler, runner: HostListRunner) -> list:
    plan, outputs = s.schedule()
    return outputs if plan is None else outputs + s.finish_step(plan, runner.run(plan)).outputs


def test_a_prompt_continuing_into_the_host_pool_starts_after_the_restored_pages():
    s = Scheduler(
        PageAllocator(6), PAGE, 64, 16, VOCAB, 1000, {0}, max_running=4, prefix_caching=True,
        host_slots=8,
    )  # fmt: skip
    runner = HostListRunner(6, 8)
    first = list(range(2, 23))  # 21 tokens: pages 0-4 full
    for rid, prompt in (("a", first), ("b", list(range(25, 48)))):  # b's 6 pages evict all of a's
        s.add(Request(rid, list(prompt), SamplingParams(max_tokens=1, seed=0), Policy.AGGREGATED))
        while s.requests:
            step(s, runner)
    pool = s.host_pools[0]
    assert pool.num_offloaded == 5 and s.allocator.num_cached == 5  # b's pages only
    again = Request("a2", list(first), SamplingParams(max_tokens=2, seed=0), Policy.AGGREGATED)
    s.add(again)
    assert again.num_computed == 20 and again.num_cached_tokens == 20  # the host's 5 pages
    # a2's 6 pages evicted b's 5 to the host, whose 3 free slots and then b's own oldest took them
    assert pool.num_restored == 5 and pool.num_offloaded == 10 and pool.num_stored == 3
    got = []
    while s.requests:
        got += [t for out in step(s, runner) for t in out.token_ids]
    assert got == expected(first, 2)
    pool.check()
    s.allocator.check()


def test_off_without_the_prefix_cache_and_bad_sizes_raise():
    s = Scheduler(PageAllocator(8), PAGE, 64, 16, VOCAB, 1000, {0}, host_slots=4)
    assert s.host_pools == [] and s.allocator.on_evict is None
    with pytest.raises(ValueError, match="host_slots=-1"):
        Scheduler(PageAllocator(8), PAGE, 64, 16, VOCAB, 1000, {0}, host_slots=-1)


@pytest.mark.parametrize(
    "total, fixed_chunks, ranks, num_slots, policy",
    [
        (3_000, False, 1, 24, Policy.AGGREGATED),
        (1_000, True, 1, 24, Policy.AGGREGATED),  # batch-invariant mode: restores of whole chunks
        (1_000, False, 2, 12, Policy.AGGREGATED),  # data-parallel attention: a pool per rank
        (1_000, False, 1, 3, Policy.AGGREGATED),  # a pool smaller than a prompt: slots reused
        (1_000, False, 1, 24, Policy.PREFILL_ONLY),  # a prefill worker: restores in `schedule`
        (1_000, False, 1, 24, "issued"),  # copies issued when decided, as a worker does
    ],
)
def test_evictions_to_the_host_and_restores_leak_no_page_or_slot(
    total, fixed_chunks, ranks, num_slots, policy
):
    issued = policy == "issued"
    policy = Policy.AGGREGATED if issued else policy
    rng = random.Random(total + ranks + num_slots)
    num_pages = 32 // ranks
    s = Scheduler(
        [PageAllocator(num_pages) for _ in range(ranks)], PAGE, 48, 16 if fixed_chunks else 10,
        VOCAB, 1000, {0}, max_running=8, fixed_chunks=fixed_chunks, prefix_caching=True,
        host_slots=num_slots,
    )  # fmt: skip
    runner = HostListRunner(num_pages, num_slots, ranks)
    runner.allocators = s.allocators
    if issued:
        s.issue_host_copies = runner.copy
    blocks = [[rng.randrange(2, VOCAB) for _ in range(PAGE)] for _ in range(4)]
    prefixes = [
        [t for _ in range(rng.randrange(1, 9)) for t in rng.choice(blocks)] for _ in range(30)
    ]  # fmt: skip
    got: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    submitted = finished = steps = 0
    sending: list[str] = []  # prefill-only requests whose KV is being sent
    pending: Request | None = None

    def submit(most: int) -> None:
        """Adds requests up to `most` live ones, or until the scheduler is full."""
        nonlocal pending, submitted
        while submitted < total and len(s.requests) < most:
            if pending is None:
                prompt = rng.choice(prefixes) + [rng.randrange(2, VOCAB) for _ in range(4)]
                params = SamplingParams(max_tokens=rng.randrange(1, 4), seed=0)
                pending = Request(f"r{submitted}", prompt, params, policy)
            try:
                s.add(pending)
            except CapacityError:
                return
            prompts[pending.request_id], got[pending.request_id] = list(pending.token_ids), []
            pending, submitted = None, submitted + 1

    while submitted < total or s.requests:
        submit(8)
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        while sending and rng.random() < 0.5:  # a send acknowledged
            s.release(sending.pop(rng.randrange(len(sending))))
            finished += 1
        plan, outputs = s.schedule()
        steps += 1
        if plan is not None:
            if rng.random() < 0.05 and s.requests:  # a cancel while the step runs
                s.abort(rng.choice(list(s.requests)))
            if issued and rng.random() < 0.3:  # admitted while the step runs, its copies issued
                submit(len(s.requests) + 1)
            assert not issued or not any(plan.host_copies)
            held = s._in_flight.host_held
            for pool, h in zip(s.host_pools, held, strict=True):
                pool.check(in_flight=h)
            outcome = s.finish_step(plan, runner.run(plan))
            outputs += outcome.outputs
            for request, token, _ in outcome.to_send:
                assert [token] == expected(prompts[request.request_id], 1), request.request_id
                sending.append(request.request_id)
        for out in outputs:
            got[out.request_id] += out.token_ids
            if out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                finished += 1
                tokens = got[out.request_id]
                assert tokens == expected(prompts[out.request_id], len(tokens)), out.request_id
        sending = [rid for rid in sending if rid in s.requests]  # those not cancelled
        assert steps < 20 * total, "no progress"
    for a, pool in zip(s.allocators, s.host_pools, strict=True):
        a.check()
        pool.check()
        assert a.num_used == 0 and a.num_free == num_pages
        assert pool.num_restored > total // 50 // ranks  # the host tier was hit
        assert pool.num_stored <= num_slots
    assert finished > total // 2
    assert s.num_preemptions > 0 or policy is Policy.PREFILL_ONLY


def test_pages_a_transfer_writes_are_never_copied():
    """A decode-only request's pages are written by its KV transfer, outside any step: the cached pages evicted
    for it are not stored, and it is refused (busy) where a page it would get has a copy pending."""
    s = Scheduler(
        PageAllocator(6), PAGE, 64, 16, VOCAB, 1000, {0}, max_running=4, prefix_caching=True,
        host_slots=8,
    )  # fmt: skip
    runner = HostListRunner(6, 8)
    prompt = list(range(2, 23))  # 5 full pages cached
    s.add(Request("a", list(prompt), SamplingParams(max_tokens=1, seed=0), Policy.AGGREGATED))
    while s.requests:
        step(s, runner)
    pool = s.host_pools[0]
    d = Request("d", list(range(25, 40)), SamplingParams(max_tokens=1, seed=0), Policy.DECODE_ONLY)
    s.add(d)  # 4 pages: the free one and 3 of a's evicted, not stored
    assert pool.num_dropped == 3 and pool.num_offloaded == 0 and pool.pending() == []
    assert s.allocator.on_evict == pool.offload
    s.abort("d")
    # b evicts one of a's 2 pages left to the host (a copy pending), then goes away before any step
    b = Request("b", list(range(30, 50)), SamplingParams(max_tokens=1, seed=0), Policy.AGGREGATED)
    s.add(b)
    assert pool.num_offloaded == 1 and len(pool.busy_pages()) == 1
    s.abort("b")
    free = s.allocator.num_free
    d2 = Request("d2", list(range(2, 23)), SamplingParams(max_tokens=1, seed=0), Policy.DECODE_ONLY)
    with pytest.raises(CapacityError, match="busy with host-tier copies"):
        s.add(d2)
    assert s.allocator.num_free == free and "d2" not in s.requests
    step(s, runner)  # nothing to run: the copies wait for the next plan
    s.add(Request("c", list(range(2, 10)), SamplingParams(max_tokens=1, seed=0), Policy.AGGREGATED))
    while s.requests:
        step(s, runner)
    assert pool.busy_pages() == set()
    s.allocator.check()
    pool.check()
