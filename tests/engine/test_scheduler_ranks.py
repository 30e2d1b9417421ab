"""The scheduler core over a worker of several ranks (pure Python, no model): data-parallel attention (one page
allocator per rank, each request on one rank, one `RankStep` per rank, each rank's result mapped back to its own
requests) and tensor-parallel attention (one allocator, the same rows on every rank, rank 0's result taken)."""

from __future__ import annotations

import pytest

from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import RankResult, StepPlan
from pdserve.model.errors import CapacityError

PAGE = 4


def dp_scheduler(ranks=2, num_pages=8, max_running=16) -> Scheduler:
    return Scheduler(
        [PageAllocator(num_pages) for _ in range(ranks)], PAGE, 64, 16, 100, 1000, {1},
        max_running=max_running, worker_kind="decode worker",
    )  # fmt: skip


def request(rid, n, max_tokens=8, policy=Policy.AGGREGATED) -> Request:
    return Request(
        rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, seed=0), policy
    )


def results(plan: StepPlan, token_of_rank) -> list[RankResult]:
    """Each rank's result as its runner would give it: token_of_rank(rank) for every row that samples."""
    return [
        RankResult(
            plan.step_id,
            [token_of_rank(d) if row.sample is not None else None for row in step.prefill],
            [token_of_rank(d)] * len(step.decode),
        )
        for d, step in enumerate(plan.ranks)
    ]


def test_requests_are_spread_by_pages_then_count_and_keep_their_rank():
    s = dp_scheduler()
    big, small, third = request("big", 9), request("small", 2), request("third", 2)
    for r in (big, small, third):
        s.add(r)
    # big (3 pages) to rank 0; small to rank 1 (fewer pages); third to rank 1 (1 page in use < 3)
    assert [big.rank, small.rank, third.rank] == [0, 1, 1]
    assert sorted(s.allocators[0]._refs) == sorted(big.pages)
    assert sorted(s.allocators[1]._refs) == sorted(small.pages + third.pages)
    assert s.num_used_pages == 5 and s.num_pages == 16

    plan, _ = s.schedule()
    assert len(plan.ranks) == 2
    assert [row.request_id for row in plan.ranks[0].prefill] == ["big"]
    assert [row.request_id for row in plan.ranks[1].prefill] == ["small", "third"]
    # each rank's tokens go to its own requests
    out = s.finish_step(plan, results(plan, lambda d: 50 + d)).outputs
    assert {o.request_id: o.token_ids for o in out} == {"big": [50], "small": [51], "third": [51]}

    s.abort("big")  # rank 0 now idle
    plan, _ = s.schedule()
    assert plan.ranks[0].is_empty
    assert [row.request_id for row in plan.ranks[1].decode] == ["small", "third"]
    s.finish_step(plan, results(plan, lambda d: 60 + d))
    assert small.token_ids[-1] == third.token_ids[-1] == 61
    assert s.allocators[0].num_used == 0


def test_a_rank_holds_at_most_its_share_of_max_running():
    """max_running 5 over 2 ranks: 3 a rank at most (the decode graphs a rank captures go to 3 rows), even where
    a rank's pages would take more; the worker's bound still holds."""
    s = dp_scheduler(max_running=5)
    assert s.rank_max_running == 3
    big = request(
        "big", 13
    )  # 4 of rank 0's 8 pages: the next three go to rank 1 (fewer pages in use)
    s.add(big)
    small = [request(f"s{i}", 2) for i in range(4)]
    for r in small:
        s.add(r)
    assert [r.rank for r in small] == [
        1,
        1,
        1,
        0,
    ]  # rank 1 at its share, though it has the most free pages
    assert not s.can_admit(2)  # the worker's 5
    s.abort("big")
    assert s.can_admit(2)


def test_a_rank_full_preempts_only_its_own_requests():
    s = dp_scheduler(num_pages=2)
    # one page each; the token after the first generated one needs a second page
    a, b, c = request("a", 4, 2), request("b", 4, 2), request("c", 4, 2)
    for r in (a, b, c):
        s.add(r)
    assert [a.rank, b.rank, c.rank] == [0, 1, 0]
    plan, _ = s.schedule()
    s.finish_step(plan, results(plan, lambda d: 20))
    # a and c on rank 0 both need a second page; rank 0 has none free: c (newest on rank 0) is preempted,
    # b on rank 1 keeps running although rank 1 has a free page
    plan, _ = s.schedule()
    assert c.state is RequestState.WAITING and s.num_preemptions == 1
    assert [row.request_id for row in plan.ranks[0].decode] == ["a"]
    assert [row.request_id for row in plan.ranks[1].decode] == ["b"]
    assert s.allocators[0].num_used == 2 and s.allocators[1].num_used == 2


def test_admission_refused_only_when_no_rank_has_room():
    s = dp_scheduler(num_pages=3)
    s.add(request("a", 9, 2))
    s.add(request("b", 9, 2))
    assert not s.can_admit(1)
    with pytest.raises(CapacityError, match="0/0 free KV pages"):
        s.add(request("c", 1, 2))
    s.abort("a")
    assert s.can_admit(9)


def test_tensor_parallel_replicates_rows_and_takes_rank_0():
    s = Scheduler(PageAllocator(8), PAGE, 64, 16, 100, 1000, {1}, ranks=2)
    a, b = request("a", 5), request("b", 3)
    s.add(a)
    s.add(b)
    assert a.rank == b.rank == 0
    plan, _ = s.schedule()
    assert len(plan.ranks) == 2 and plan.ranks[0] == plan.ranks[1]
    out = s.finish_step(plan, results(plan, lambda d: 30 + d)).outputs
    assert {o.request_id: o.token_ids for o in out} == {"a": [30], "b": [30]}
    with pytest.raises(AssertionError, match="1 results for 2 ranks"):
        plan, _ = s.schedule()
        s.finish_step(plan, results(plan, lambda d: 30)[:1])


def test_allocators_must_match_the_ranks():
    with pytest.raises(ValueError, match="3 page allocators for ranks=2"):
        Scheduler([PageAllocator(4)] * 3, PAGE, 64, 16, 100, 1000, {1}, ranks=2)
    with pytest.raises(ValueError, match="unequal sizes"):
        Scheduler([PageAllocator(4), PageAllocator(5)], PAGE, 64, 16, 100, 1000, {1})
