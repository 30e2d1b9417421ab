"""The prefill scheduler on its own: FIFO under a token budget, chunking, head-of-line page allocation."""

from __future__ import annotations

import pytest

from pdserve.engine.messages import PrefillRequest
from pdserve.model.errors import CapacityError
from pdserve.model.pages import PageAllocator
from pdserve.model.sampling_params import SamplingParams
from pdserve.prefill.scheduler import PrefillScheduler, PrefillState


def request(rid: str, n: int) -> PrefillRequest:
    return PrefillRequest(rid, list(range(3, 3 + n)), SamplingParams(seed=0), 0, "d0", 1)


def test_budget_and_chunks():
    s = PrefillScheduler(PageAllocator(64), 4, token_budget=10, max_chunk=6, vocab_size=100)
    for rid, n in (("a", 9), ("b", 3), ("c", 5)):
        s.add(request(rid, n))
    assert s.queued_tokens == 17
    plan = s.schedule()
    assert [(c.seq.request.request_id, c.start, c.length, c.is_last) for c in plan] == [
        ("a", 0, 6, False), ("b", 0, 3, True), ("c", 0, 1, False),
    ]  # fmt: skip
    for c in plan:
        s.chunk_done(c)
    assert s.seqs["b"].state is PrefillState.SENDING
    plan = s.schedule()
    assert [(c.seq.request.request_id, c.start, c.length) for c in plan] == [
        ("a", 6, 3),
        ("c", 1, 4),
    ]
    for c in plan:
        s.chunk_done(c)
    assert s.queued_tokens == 0
    for rid in "abc":
        assert len(s.release(rid)) > 0


def test_fixed_chunks_cut_prompts_only_at_chunk_multiples():
    """Batch-invariant mode: "c" is not cut where the budget ran out; it waits for the next step."""
    s = PrefillScheduler(
        PageAllocator(64), 4, token_budget=10, max_chunk=6, vocab_size=100, fixed_chunks=True
    )
    for rid, n in (("a", 9), ("b", 3), ("c", 5)):
        s.add(request(rid, n))
    steps = []
    while s.queued_tokens:
        plan = s.schedule()
        steps.append([(c.seq.request.request_id, c.start, c.length) for c in plan])
        for c in plan:
            s.chunk_done(c)
    assert steps == [[("a", 0, 6), ("b", 0, 3)], [("a", 6, 3), ("c", 0, 5)]]


def test_pages_wait_at_the_head_of_the_line():
    alloc = PageAllocator(4)
    s = PrefillScheduler(alloc, 4, token_budget=100, max_chunk=100, vocab_size=100)
    s.add(request("a", 12))
    s.add(request("b", 8))  # needs 2 pages, only 1 left after a
    s.add(request("c", 1))
    plan = s.schedule()
    assert [c.seq.request.request_id for c in plan] == ["a"], "b blocks c: first come first served"
    s.chunk_done(plan[0])
    alloc.free(s.release("a"))
    assert [c.seq.request.request_id for c in s.schedule()] == ["b", "c"]


def test_a_prompt_that_can_never_fit_is_refused():
    s = PrefillScheduler(PageAllocator(2), 4, 100, 100, 100)
    with pytest.raises(CapacityError, match="need 3 KV pages"):
        s.add(request("a", 9))
