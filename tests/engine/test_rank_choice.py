"""The data-parallel rank a request goes to (`engine.rank_choice`, pure Python): the rank holding its prefix,
balanced against load (a cached page counts as a page of load, a page in the rank's host pool half as much);
through the scheduler for a prefilled request (its prefix cache hit, on the GPU or in the host tier) and for a
decode-only one (the pages its transfer need not carry)."""

from __future__ import annotations

import pytest

from pdserve.engine.pages import PageAllocator
from pdserve.engine.prefix_cache import chain_hashes
from pdserve.engine.rank_choice import HOST_HIT_WEIGHT, pick_rank
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import RankResult

PAGE = 4
PREFIX = list(range(3, 20))  # 17 tokens: 4 full pages


def test_a_hit_outweighs_as_many_pages_of_load():
    every = lambda d: True  # noqa: E731
    assert pick_rank([5, 2], [1, 1], [4, 0], every, None) == 0  # 5 - 4 < 2
    assert pick_rank([7, 2], [1, 1], [4, 0], every, None) == 1  # 7 - 4 > 2
    assert pick_rank([6, 2], [3, 1], [4, 0], every, None) == 1  # a tie: the fewer requests
    assert pick_rank([0, 0], [0, 0], [0, 0], every, None) == 0  # no hit: the least loaded, lowest
    assert pick_rank([5, 2], [2, 1], [4, 0], every, cap=2) == 1  # rank 0 is at its cap
    assert pick_rank([5, 2], [1, 1], [4, 0], lambda d: d == 1, None) == 1  # no room on rank 0
    assert pick_rank([5, 2], [2, 2], [4, 0], every, cap=2) is None
    with pytest.raises(ValueError, match="ranks disagree"):
        pick_rank([1, 2], [0], [0, 0], every, None)


def test_a_host_hit_counts_for_less_than_a_gpu_hit_of_the_same_length():
    every = lambda d: True  # noqa: E731
    assert HOST_HIT_WEIGHT == 0.5
    # a host-held prefix attracts the request over an equally loaded rank holding nothing
    assert pick_rank([2, 2], [1, 1], [0, 0], every, None, host_hits=[0, 4]) == 1
    # a GPU hit beats a host hit of the same length, at equal load
    assert pick_rank([2, 2], [1, 1], [4, 0], every, None, host_hits=[0, 4]) == 0
    assert pick_rank([2, 2], [1, 1], [0, 4], every, None, host_hits=[4, 0]) == 1
    # load outweighs a host hit twice as soon as a GPU hit: 3 pages more beat 4 host pages, not 4 GPU pages
    assert pick_rank([5, 2], [1, 1], [0, 0], every, None, host_hits=[4, 0]) == 1
    assert pick_rank([5, 2], [1, 1], [4, 0], every, None) == 0
    # host pages after a GPU hit add to it
    assert pick_rank([6, 1], [1, 1], [4, 0], every, None, host_hits=[4, 0]) == 0  # 6 - 4 - 2 < 1
    assert pick_rank([6, 1], [1, 1], [4, 0], every, None) == 1  # 6 - 4 > 1
    with pytest.raises(ValueError, match="1 host hits"):
        pick_rank([1, 2], [0, 0], [0, 0], every, None, host_hits=[0])


def scheduler(**kw) -> Scheduler:
    return Scheduler(
        [PageAllocator(16), PageAllocator(16)], PAGE, 64, 16, 100, 1000, {1},
        worker_kind="decode worker", prefix_caching=True, **kw,
    )  # fmt: skip


def request(rid: str, tokens: list[int], policy=Policy.AGGREGATED, max_tokens=1) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, seed=0), policy)


def run_to_end(s: Scheduler, r: Request) -> None:
    """Steps `s` (every sampled token 50) until `r` finished."""
    while r.state is not RequestState.FINISHED:
        plan, _ = s.schedule()
        s.finish_step(
            plan,
            [
                RankResult(
                    plan.step_id,
                    [50 if row.sample is not None else None for row in step.prefill],
                    [50] * len(step.decode),
                )
                for step in plan.ranks
            ],
        )


@pytest.mark.parametrize("load, rank", [(8, 0), (24, 1)], ids=["hit-wins", "load-wins"])
def test_a_prefilled_request_goes_to_the_rank_of_its_prefix_unless_it_is_loaded_more(load, rank):
    """Rank 0 caches the prefix (4 pages), then runs a request of 2 or 6 pages: the next request of that
    prefix goes there while 2 - 4 < 0, and to the idle rank 1 once 6 - 4 > 0."""
    s = scheduler()
    first = request("first", PREFIX)
    s.add(first)
    run_to_end(s, first)
    assert first.rank == 0 and s.allocators[0].num_cached == 4 and s.num_used_pages == 0
    s.add(request("load", range(40, 40 + load), max_tokens=8))
    assert s.requests["load"].rank == 0  # no hit anywhere: the lowest rank of equal load
    again = request("again", [*PREFIX, 60, 61, 62])
    s.add(again)
    assert again.rank == rank
    assert again.num_cached_tokens == (16 if rank == 0 else 0)


def test_a_decode_only_request_goes_to_the_rank_holding_its_first_pages():
    s = scheduler(reuse_held=True)
    s.add(request("other", range(40, 48), Policy.DECODE_ONLY))  # 2 pages on rank 0
    first = request("first", PREFIX, Policy.DECODE_ONLY, max_tokens=3)
    s.add(first)
    assert first.rank == 1 and first.num_held_pages == 0
    s.kv_arrived(first.transfer_id, len(PREFIX), 50)  # its prompt's 4 full pages cached on arrival
    assert s.allocators[1].num_cached == 4
    run_to_end(s, first)
    # rank 1 holds 4 of the next turn's pages (19 tokens computed), rank 0 runs 2 pages: rank 1
    turn = request("turn", [*first.token_ids, 70, 71, 72], Policy.DECODE_ONLY)
    s.add(turn)
    assert (turn.rank, turn.num_held_pages) == (1, 4)
    assert turn.pages[:4] == s.allocators[1].match(turn.page_hashes[:4])
    assert s.num_held_pages == 4 and turn.num_cached_tokens is None
    s.abort("turn")
    s.abort("other")
    assert s.num_used_pages == 0
    for a in s.allocators:
        a.check()


def test_a_prefilled_request_goes_to_the_rank_holding_its_prefix_in_host_memory():
    """Rank 0 computes the prefix, then another prompt fills rank 0's pages: the prefix's pages go to rank 0's
    host pool. With a page of load more on rank 0, the next request of that prefix still goes there (1 - 4/2 <
    0, where without the host hit the idle rank 1 would take it) and starts after the 4 pages restored."""
    s = Scheduler(
        [PageAllocator(8), PageAllocator(8)], PAGE, 64, 16, 100, 1000, {1},
        worker_kind="decode worker", prefix_caching=True, host_slots=8,
    )  # fmt: skip
    first = request("first", PREFIX)
    s.add(first)
    run_to_end(s, first)
    fill = request("fill", range(30, 61))  # 8 pages: rank 0's (the lowest of equal load)
    s.add(fill)
    run_to_end(s, fill)
    hashes = chain_hashes(PREFIX, PAGE, 4, lookahead=False)
    assert fill.rank == 0 and s.allocators[0].match(hashes) == []
    assert s.host_pools[0].match(hashes) == 4 and s.host_pools[1].match(hashes) == 0
    s.add(request("load", range(70, 74), max_tokens=4))  # 1 page on rank 0
    assert s.requests["load"].rank == 0
    again = request("again", [*PREFIX, 60, 61, 62])
    s.add(again)
    assert again.rank == 0 and again.num_cached_tokens == 16
    assert s.host_pools[0].num_restored == 4
    for rid in ("again", "load"):
        s.abort(rid)
    assert s.num_used_pages == 0
