"""Decode-side KV reuse without a model (`tests/model_free.py`): a decode worker keeps the pages of the KV it
received and of its finished requests in its prefix cache, and the next turn of a conversation gets from its
prefill worker only the pages the decode worker does not hold; the stream is the one every page sent gives. The
held pages are referenced from the reservation on (nothing evicts them while the transfer is awaited); pages
evicted before the reservation are simply sent; a transfer that fails, an abort, or a prefill worker told to
skip more pages than were held leaves no page referenced and no wrong token."""

from __future__ import annotations

import pytest
from model_free import PAGE, FaultyHub, Streams, decode_worker, prefill_worker, pump, reference

from pdserve import kernels
from pdserve.engine.messages import DecodeRequest, PrefillRequest, Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import CapacityError, InvalidRequestError

pytestmark = pytest.mark.timed

PROMPT = list(range(3, 14))  # 11 tokens: 3 pages
PARAMS = SamplingParams(max_tokens=6, seed=1)
MORE = [20, 21, 22, 23, 24]


@pytest.fixture
def hub() -> FaultyHub:
    return FaultyHub()


def place(p, d, rid: str, prompt: list[int], params=PARAMS, held: int | None = None) -> Reservation:
    """Reserves on d and submits to p as the router does (`held`: the held pages p is told of, where a
    test makes it wrong); returns the reservation."""
    reservation = d.add_request(DecodeRequest(rid, prompt, params, p.worker_id))
    held = reservation.num_held_pages if held is None else held
    p.submit(
        PrefillRequest(
            rid, prompt, params, 0, d.worker_id, reservation.transfer_id, reservation.dest_cuts,
            held,
        )
    )  # fmt: skip
    return reservation


def all_free(*workers) -> bool:
    for w in workers:
        for a in w.allocators:
            a.check()
    return all(w.num_used_pages == 0 and not w.scheduler.requests for w in workers)


def first_turn(p, d, streams: Streams) -> list[int]:
    """Runs the conversation's first turn (PROMPT) to its end; returns the second turn's prompt (PROMPT, its
    answer, MORE: 22 tokens, 6 pages)."""
    assert place(p, d, "a", PROMPT).num_held_pages == 0
    pump([p, d], streams.ended("a"))
    assert streams.tokens["a"] == reference(PROMPT, 6)
    pump([p], lambda: all_free(p))
    return [*PROMPT, *streams.tokens["a"], *MORE]


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_the_next_turn_gets_only_the_pages_its_decode_worker_does_not_hold(hub, batch_invariant):
    """Default mode: the first turn's pages of its 16 computed tokens (4) stay held; batch-invariant mode:
    only the pages a prefill made (the 2 full pages of its prompt before its last token; decode rows' KV
    differs from a prefill's in the last bits there)."""
    with kernels.use_batch_invariant(batch_invariant):
        p = prefill_worker(hub, send_timeout_s=2.0)
        d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        held = 2 if batch_invariant else 4
        reservation = place(p, d, "b", second)
        assert (reservation.num_pages, reservation.num_held_pages) == (6, held)
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
        pump([p], lambda: all_free(p))
        stats = p.stats()
        assert (stats.kv_pages_sent, stats.kv_pages_not_sent) == (3 + 6 - held, held)
        assert stats.kv_bytes_not_sent == held * p.runner.cache.layout.page_bytes
        assert stats.kv_bytes_sent == stats.kv_pages_sent * p.runner.cache.layout.page_bytes
        assert d.stats().kv_held_pages == held
        assert all_free(p, d) and not p.poll_failures()
    finally:
        p.close()
        d.close()


def test_without_reuse_every_page_travels(hub):
    p = prefill_worker(hub, send_timeout_s=2.0)
    d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0, reuse_held_prefix=False)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        assert place(p, d, "b", second).num_held_pages == 0
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
        pump([p], lambda: all_free(p))
        assert (p.stats().kv_pages_sent, p.stats().kv_pages_not_sent) == (9, 0)
    finally:
        p.close()
        d.close()


def test_pages_evicted_before_the_reservation_are_sent(hub):
    """The router expected d0 to hold the first turn (its events were a poll late), but another request
    took every page meanwhile: the reservation holds none and the whole KV travels."""
    p = prefill_worker(hub, num_pages=16, send_timeout_s=2.0)
    d = decode_worker(hub, num_pages=8, kv_wait_timeout_s=2.0)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        other = list(range(30, 60))  # 30 tokens: all of d0's 8 pages
        place(p, d, "c", other, SamplingParams(max_tokens=2, seed=3))
        assert d.scheduler.allocator.num_evicted == 4
        pump([p, d], streams.ended("c"))
        assert place(p, d, "b", second).num_held_pages == 0
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
        pump([p], lambda: all_free(p))
        assert all_free(p, d) and p.stats().kv_pages_not_sent == 0
    finally:
        p.close()
        d.close()


def test_held_pages_are_not_evicted_while_the_transfer_is_awaited(hub):
    p = prefill_worker(hub, send_timeout_s=5.0)
    d = decode_worker(hub, num_pages=12, kv_wait_timeout_s=5.0)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        reservation = place(p, d, "b", second)
        gate = hub.hold("d0", reservation.transfer_id)
        pump([p], lambda: p.stats().num_sending == 1, what="b's send under way")
        held = d.scheduler.requests["b"].pages[: reservation.num_held_pages]
        assert len(held) == 4 and d.scheduler.allocator.num_free == 12 - 6
        # a request that would need the held pages is refused rather than given them
        with pytest.raises(CapacityError):
            d.add_request(DecodeRequest("c", list(range(30, 57)), SamplingParams(max_tokens=1)))
        assert d.scheduler.allocator.match(d.scheduler.requests["b"].page_hashes[:4]) == held
        hub.release(gate)
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
        pump([p], lambda: all_free(p))
        assert all_free(p, d)
    finally:
        p.close()
        d.close()


def test_a_failed_transfer_or_an_abort_leaves_no_held_page_referenced(hub):
    p = prefill_worker(hub, send_timeout_s=0.3)
    d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=0.3)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        cached = d.scheduler.allocator.num_cached
        hub.fault("d0", place(p, d, "b", second).transfer_id, drop=True)
        pump([p, d], streams.ended("b"), what="b's failure")
        assert streams.finish["b"] == "abort" and "before the deadline" in streams.errors["b"]
        pump([p], lambda: all_free(p))
        assert all_free(p, d) and "b" in {f.request_id for f in p.poll_failures()}
        assert d.scheduler.allocator.num_cached == cached  # still cached, unreferenced
        # aborted while its KV is awaited (the router's cleanup): its references go
        assert place(p, d, "c", second).num_held_pages == 4
        d.abort("c")
        p.abort("c")
        pump([p, d], lambda: all_free(p, d), what="c's cleanup")
        # and the pages serve the next try
        assert place(p, d, "b2", second).num_held_pages == 4
        pump([p, d], streams.ended("b2"))
        assert streams.tokens["b2"] == reference(second, 6)
        pump([p], lambda: all_free(p))
        assert all_free(p, d)
    finally:
        p.close()
        d.close()


def test_a_prefill_worker_told_of_more_held_pages_fails_the_request_not_its_tokens(hub):
    """A router that passed on more held pages than the reservation holds (a bug): the transfer carries
    fewer pages than reserved, the decode worker refuses it, nothing decodes on missing KV."""
    p = prefill_worker(hub, send_timeout_s=0.5)
    d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=0.5)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)
        place(p, d, "b", second, held=5)
        pump([p, d], streams.ended("b"), what="b's failure")
        assert streams.finish["b"] == "abort" and streams.tokens.get("b", []) == []
        assert "1 pages for 2 reserved" in streams.errors["b"]
        pump([p], lambda: all_free(p))
        assert all_free(p, d)
        with pytest.raises(InvalidRequestError, match="num_held_pages"):
            place(p, d, "c", second, held=6)  # every page: nothing would carry the first token
        d.abort("c")
        assert all_free(p, d)
    finally:
        p.close()
        d.close()


def test_held_pages_fill_the_reservation_on_any_page_size(hub):
    """A second turn that is a page multiple long holds all but its last page."""
    p = prefill_worker(hub, send_timeout_s=2.0)
    d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0)
    try:
        streams = Streams(d)
        second = first_turn(p, d, streams)[: 5 * PAGE]  # 20 tokens: PROMPT, its answer, 3 more
        reservation = place(p, d, "b", second)
        assert (reservation.num_pages, reservation.num_held_pages) == (5, 4)
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_pages_a_decode_worker_prefilled_itself_stand_in_only_outside_batch_invariant_mode(
    hub, batch_invariant
):
    """d0 prefills a first turn itself (aggregated) and the second turn's KV comes from p0; then p0 computes a
    first turn and d0 prefills the second. In batch-invariant mode d0's own chunks and p0's made other bits
    (chunks of other sizes): neither kind of page stands in for the other; otherwise they do."""
    with kernels.use_batch_invariant(batch_invariant):
        p = prefill_worker(hub, send_timeout_s=2.0, max_prefill_chunk=16)
        d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0, max_prefill_chunk=8)
    try:
        streams = Streams(d)
        d.add_request(DecodeRequest("a", PROMPT, PARAMS))
        pump([d], streams.ended("a"))
        second = [*PROMPT, *streams.tokens["a"], *MORE]
        assert place(p, d, "b", second).num_held_pages == (0 if batch_invariant else 4)
        pump([p, d], streams.ended("b"))
        assert streams.tokens["b"] == reference(second, 6)
        other = list(range(30, 50))  # 20 tokens: its first 4 pages kept as they arrive
        place(p, d, "c", other)
        pump([p, d], streams.ended("c"))
        hits = d.stats().prefix_cache_hits
        next_turn = [*other, *streams.tokens["c"], 7]
        d.add_request(DecodeRequest("e", next_turn, PARAMS))
        pump([d], streams.ended("e"))
        assert streams.tokens["e"] == reference(next_turn, 6)
        assert d.stats().prefix_cache_hits - hits == (0 if batch_invariant else 24)
        pump([p], lambda: all_free(p))
        assert all_free(p, d)
    finally:
        p.close()
        d.close()
