"""The prefill and decode workers, their schedulers and the KV transfer's state machine without a model
(`tests/model_free.py`): every abort and failure path ends with every page free on both sides, and a request
that goes on streams exactly the tokens its prompt gives when every page is where it should be."""

from __future__ import annotations

import dataclasses
import time

import pytest
from model_free import FaultyHub, Streams, decode_worker, prefill_worker, pump, reference

from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import CapacityError, InvalidRequestError

pytestmark = pytest.mark.timed

PROMPT = list(range(3, 14))  # 11 tokens: 3 pages
PARAMS = SamplingParams(max_tokens=6, seed=1)


@pytest.fixture
def hub() -> FaultyHub:
    return FaultyHub()


@pytest.fixture
def pair(hub):
    """A prefill worker p0 and a decode worker d0 joined by `hub`; p0's sends are waited for at the end."""
    p, d = (
        prefill_worker(hub, send_timeout_s=2.0),
        decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0),
    )
    yield p, d
    p.close()
    d.close()


def place(p, d, rid: str, prompt=PROMPT, params=PARAMS, generated=()) -> int:
    """Reserves on d, submits to p (as the router does); returns the transfer id."""
    reservation = d.add_request(DecodeRequest(rid, prompt, params, p.worker_id, list(generated)))
    p.submit(
        PrefillRequest(
            rid,
            [*prompt, *generated],
            params,
            len(generated),
            d.worker_id,
            reservation.transfer_id,
            reservation.dest_cuts,
            reservation.num_held_pages,
        )  # fmt: skip
    )
    return reservation.transfer_id


def state(worker, rid: str) -> RequestState | None:
    request = worker.scheduler.requests.get(rid)
    return None if request is None else request.state


def all_free(*workers) -> bool:
    return all(w.num_used_pages == 0 and not w.scheduler.requests for w in workers)


def failures(p) -> dict[str, str]:
    return {f.request_id: f.error for f in p.poll_failures()}


def test_disaggregated_and_aggregated_requests_stream_the_reference_tokens(pair):
    p, d = pair
    streams = Streams(d)
    place(p, d, "a")
    place(p, d, "b", list(range(20, 25)), SamplingParams(max_tokens=9, seed=2))
    d.add_request(DecodeRequest("c", [7, 8, 9], SamplingParams(max_tokens=4, seed=3)))
    pump([p, d], streams.ended("a", "b", "c"))
    assert streams.tokens == {
        "a": reference(PROMPT, 6), "b": reference(list(range(20, 25)), 9),
        "c": reference([7, 8, 9], 4),
    }  # fmt: skip
    assert set(streams.finish.values()) == {"length"}
    pump([p], lambda: all_free(p), what="p0's acknowledgements")
    assert all_free(p, d) and not failures(p)


# Aborts, in each state.


def test_abort_while_waiting_for_pages_or_kv(pair):
    p, d = pair
    streams = Streams(d)
    place(p, d, "a", list(range(3, 3 + 60)))  # 15 of p0's 16 pages
    place(p, d, "b")  # waits for pages on p0, for KV on d0
    assert p.step() and state(p, "b") is RequestState.WAITING
    assert state(d, "b") is RequestState.WAITING_FOR_KV
    p.abort("b")
    d.abort("b")
    assert streams.collect().finish["b"] == "abort" and state(p, "b") is None
    pump([p, d], streams.ended("a"), what="a's stream")
    pump([p], lambda: all_free(p))
    assert all_free(p, d) and not failures(p)


def test_abort_mid_prefill_step_holds_the_pages_until_the_step_ends(pair):
    p, d = pair
    streams = Streams(d)
    place(p, d, "a", list(range(3, 3 + 20)))  # p0 prefills it in 3 chunks of 8
    seen = []

    def abort_in_flight(plan):
        seen.append(p.num_used_pages)
        p.abort("a")  # the router's abort lands while the pass runs
        d.abort("a")
        # the pages stay out of reach of any new request until finish_step
        assert p.scheduler.allocator.num_free == 16 - 5 and p.num_used_pages == 0

    p.runner.on_execute = abort_in_flight
    assert p.step() and seen == [5]
    p.runner.on_execute = None
    assert p.scheduler.allocator.num_free == 16 and all_free(p, d)
    assert streams.collect().finish == {"a": "abort"} and not p.step()
    assert not failures(p)  # an abort is not reported back as a failure


def test_abort_while_sending_the_send_completes_and_is_discarded(pair, hub):
    p, d = pair
    streams = Streams(d)
    held = hub.hold("d0", place(p, d, "a"))
    pump([p], lambda: state(p, "a") is RequestState.SENDING)
    p.abort("a")
    d.abort("a")  # d0 stops expecting the transfer, frees its pages
    assert (
        d.num_used_pages == 0 and p.num_used_pages == 3
    )  # p0's pages are read until the send ends
    # d0's freed pages go to another request meanwhile, which decodes: the late transfer must not write them
    place(p, d, "b", list(range(30, 41)))
    assert d.scheduler.requests["b"].pages == [0, 1, 2]  # "a"'s
    pump([p, d], lambda: streams.collect().tokens.get("b"))
    hub.release(held)
    pump([p], lambda: state(p, "a") is None, what="p0's late send")
    pump([d], streams.ended("b"))
    assert streams.tokens["b"] == reference(list(range(30, 41)), 6)
    pump([p], lambda: all_free(p))
    assert all_free(p, d) and not failures(p)


def test_abort_while_waiting_for_kv_then_the_kv_arrives(pair, hub):
    p, d = pair
    streams = Streams(d)
    held = hub.hold("d0", place(p, d, "a"))
    pump([p], lambda: state(p, "a") is RequestState.SENDING)
    d.abort("a")  # the client went away; p0's abort is still on its way
    hub.release(held)
    pump([p, d], lambda: all_free(p, d))
    assert streams.collect().finish == {"a": "abort"} and streams.tokens["a"] == []
    assert not failures(p)  # the transfer was acknowledged (and discarded)


def test_abort_mid_decode_step_emits_nothing_after_the_abort(pair):
    p, d = pair
    streams = Streams(d)
    place(p, d, "a", params=SamplingParams(max_tokens=50, seed=1))
    pump([p, d], lambda: len(streams.collect().tokens.get("a", [])) >= 3)

    def abort_in_flight(plan):
        d.abort("a")
        assert d.num_used_pages == 0 and d.scheduler.allocator.num_free < 32  # held back

    d.runner.on_execute = abort_in_flight
    assert d.step()
    d.runner.on_execute = None
    streams.collect()
    assert streams.finish == {"a": "abort"} and len(streams.tokens["a"]) == 3
    assert d.scheduler.allocator.num_free == 32 and not d.step()
    pump([p], lambda: all_free(p))
    assert all_free(p, d)


# The transfer's failures.


def test_a_dropped_transfer_times_out_on_both_sides():
    hub = FaultyHub()
    p = prefill_worker(hub, send_timeout_s=0.15)
    d = decode_worker(hub, kv_wait_timeout_s=0.1)
    streams = Streams(d)
    try:
        hub.fault("d0", place(p, d, "a"), drop=True)
        pump([p, d], streams.ended("a"), what="d0's deadline")
        assert "before the deadline" in streams.errors["a"] and d.num_used_pages == 0
        pump([p], lambda: all_free(p), what="p0's send timeout")
        (error,) = failures(p).values()
        assert "no acknowledgement within" in error and p.stats().num_send_failures == 1
    finally:
        p.close()
    assert all_free(p, d)


def test_a_transfer_later_than_the_deadline_is_discarded(hub):
    p = prefill_worker(hub, send_timeout_s=2.0)
    d = decode_worker(hub, kv_wait_timeout_s=0.05)
    streams = Streams(d)
    try:
        held = hub.hold("d0", place(p, d, "a"))
        pump([p, d], streams.ended("a"), what="d0's deadline")
        assert streams.finish == {"a": "abort"} and d.num_used_pages == 0
        d.config = dataclasses.replace(d.config, kv_wait_timeout_s=2.0)  # "b" has time
        place(p, d, "b", list(range(30, 41)))
        assert d.scheduler.requests["b"].pages == [0, 1, 2]  # "a"'s
        pump([p, d], lambda: streams.collect().tokens.get("b"))
        hub.release(
            held
        )  # "a" arrives late, while "b" decodes in its pages: acknowledged, discarded
        pump([p], lambda: state(p, "a") is None, what="p0's late send")
        pump([d], streams.ended("b"))
        assert streams.tokens["b"] == reference(list(range(30, 41)), 6)
        pump([p], lambda: all_free(p))
        assert not failures(p)
    finally:
        p.close()
    assert all_free(p, d)


def test_a_duplicate_transfer_is_discarded_at_once_or_late(hub):
    p = prefill_worker(hub, send_timeout_s=2.0)
    # "a"'s pages go back to the free list when it finishes (not kept in d0's cache), so "b" gets them
    d = decode_worker(hub, num_pages=32, kv_wait_timeout_s=2.0, reuse_held_prefix=False)
    try:
        _duplicates(p, d, hub)
    finally:
        p.close()
        d.close()


def _duplicates(p, d, hub) -> None:
    streams = Streams(d)
    first = place(p, d, "a")
    hub.fault("d0", first, duplicate=True)
    pump([p, d], streams.ended("a"))
    assert streams.tokens["a"] == reference(PROMPT, 6)  # one first token, not two
    # the duplicate again, once "a"'s pages on d0 belong to "b": before its own KV came, and after
    second = place(p, d, "b", list(range(30, 41)))
    held = hub.hold("d0", second)
    assert d.scheduler.requests["b"].pages == [0, 1, 2]  # "a"'s pages
    hub.redeliver("d0", first)
    assert state(d, "b") is RequestState.WAITING_FOR_KV
    hub.release(held)
    pump([p, d], lambda: streams.collect().tokens.get("b"))
    hub.redeliver("d0", first)
    pump([p, d], streams.ended("b"))
    assert streams.tokens["b"] == reference(list(range(30, 41)), 6)
    pump([p], lambda: all_free(p))
    assert all_free(p, d) and not failures(p)


def test_the_decode_peer_dying_mid_transfer_fails_the_send_at_once(hub):
    p = prefill_worker(hub, send_timeout_s=30.0)  # only the peer's death can end the send in time
    d = decode_worker(hub)
    try:
        hub.hold("d0", place(p, d, "a"))
        hub.hold("d0", place(p, d, "b"))
        pump([p], lambda: state(p, "b") is RequestState.SENDING)
        p.abort("a")  # the router's abort of a sending request: its failure is not reported
        start = time.monotonic()
        hub.kill("d0")
        pump([p], lambda: all_free(p), timeout_s=10.0, what="the sends' failure")
        assert time.monotonic() - start < 1.0
        errors = failures(p)
        assert list(errors) == ["b"] and "is gone" in errors["b"]
        assert p.stats().num_send_failures == 2
        # a prompt for d0 queued after it died fails at once too
        p.submit(PrefillRequest("c", PROMPT, PARAMS, 0, "d0", 99))
        pump([p], lambda: all_free(p), timeout_s=10.0)
        assert list(failures(p)) == ["c"]
    finally:
        p.close()


def test_peer_lost_fails_sends_to_a_forgotten_decode_worker(pair, hub):
    p, d = pair
    hub.hold("d0", place(p, d, "a"))
    pump([p], lambda: state(p, "a") is RequestState.SENDING)
    p.peer_lost("d0")  # the router lost d0 (its process may still be up)
    pump([p], lambda: all_free(p), timeout_s=10.0)
    assert "a" in failures(p)
    d.abort("a")  # the router's abort on d0 when it still answers
    assert all_free(d)


def test_kv_for_the_wrong_token_count_aborts(pair, hub):
    p, d = pair
    streams = Streams(d)
    reservation = d.add_request(DecodeRequest("a", PROMPT, PARAMS, "p0"))
    # p0 was told a prompt one token short (e.g. a router bug): d0 must not decode garbage
    p.submit(PrefillRequest("a", PROMPT[:-1], PARAMS, 0, "d0", reservation.transfer_id))
    pump([p, d], streams.ended("a"))
    assert "expected 11" in streams.errors["a"]
    pump([p], lambda: all_free(p))
    assert all_free(p, d)


# Failed passes, preemption, capacity.


def test_failed_passes_fail_their_requests_only(pair):
    p, d = pair
    streams = Streams(d)
    p.runner.fail_prefill = "injected prefill fault"
    place(p, d, "a")
    assert p.step()
    assert "injected prefill fault" in failures(p)["a"] and all_free(p)
    d.abort("a")  # the router's cleanup on d0
    p.runner.fail_prefill = None
    place(p, d, "b")
    pump([p, d], lambda: streams.collect().tokens.get("b"))
    d.runner.fail_decode = "injected decode fault"
    pump([p, d], streams.ended("b"))
    assert "injected decode fault" in streams.errors["b"]
    pump([p], lambda: all_free(p))
    assert all_free(p, d)


def test_preemption_recomputes_aggregated_and_hands_back_disaggregated_requests(hub):
    p = prefill_worker(hub)
    d = decode_worker(hub, num_pages=8)
    streams = Streams(d)
    try:
        long = SamplingParams(max_tokens=14, seed=1)
        d.add_request(DecodeRequest("agg", [5, 6, 7], long))  # 1 page, growing to 5
        d.add_request(DecodeRequest("agg2", [9, 8, 7], long))  # likewise
        assert d.step() and d.step()
        place(p, d, "dis", list(range(3, 11)), long)  # 2 pages, growing to 6: 16 pages for 8
        pump([p], lambda: all_free(p))  # its KV is in; from here d0's steps are one thread's
        pump([d], streams.ended("agg", "agg2", "dis"))
        assert d.stats().num_preemptions > 0 and "dis" in streams.preempted
        # a preempted aggregated request is prefilled again with its tokens: the stream goes on unchanged
        assert streams.tokens["agg"] == reference([5, 6, 7], 14)
        assert streams.tokens["agg2"] == reference([9, 8, 7], 14)
        # the router resubmits the preempted one with the tokens it has
        sent = streams.tokens["dis"]
        place(p, d, "dis2", list(range(3, 11)), long, sent)
        pump([p, d], streams.ended("dis2"))
        assert sent + streams.tokens["dis2"] == reference(list(range(3, 11)), 14)
        pump([p], lambda: all_free(p))
    finally:
        p.close()
    assert all_free(p, d)


def test_capacity_and_invalid_requests_take_no_pages(pair):
    p, d = pair
    place(p, d, "a", list(range(3, 3 + 40)))  # 10 of d0's 32 pages
    with pytest.raises(CapacityError, match="decode worker full"):
        d.add_request(DecodeRequest("b", [3] * 100, PARAMS, "p0"))
    with pytest.raises(CapacityError, match="this decode worker has 32"):
        d.add_request(DecodeRequest("c", [3] * 120, SamplingParams(max_tokens=10, seed=1)))
    with pytest.raises(CapacityError, match="this prefill worker has 16"):
        p.submit(PrefillRequest("c", [3] * 70, PARAMS, 0, "d0", 5))
    with pytest.raises(InvalidRequestError, match="already running"):
        d.add_request(DecodeRequest("a", PROMPT, PARAMS, "p0"))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        d.add_request(DecodeRequest("e", [9999], PARAMS))
    assert d.num_used_pages == 10 and p.num_used_pages == 0 and set(d.scheduler.requests) == {"a"}
    streams = Streams(d)
    pump([p, d], streams.ended("a"))
    pump([p], lambda: all_free(p))
    assert all_free(p, d)


def test_max_running_refuses_the_next_request():
    d = decode_worker(None, max_running=1)
    d.add_request(DecodeRequest("a", PROMPT, PARAMS))
    assert not d.can_admit(1)
    with pytest.raises(CapacityError, match="1/1 requests"):
        d.add_request(DecodeRequest("b", [3], PARAMS))
    streams = Streams(d)
    pump([d], streams.ended("a"))
    assert streams.tokens["a"] == reference(PROMPT, 6) and all_free(d) and d.can_admit(1)
