"""The scheduler core on its own (pure Python, no model), under each policy: decode-only admission, KV arrival,
continuous batching, stop rules, preemption order and page accounting; aggregated local prefill and its
preemption by recompute; prefill-only FIFO under a token budget, chunking and head-of-line page allocation; the
step plan it hands the runner and its msgpack round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgpack
import pytest

from pdserve.engine.messages import RequestOutput, SpecCounts, StageTimes
from pdserve.engine.pages import PageAllocator
from pdserve.engine.ranks.wire import plan_from_wire, plan_to_wire, result_from_wire, result_to_wire
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput, TokenLogprobs
from pdserve.engine.scheduler import Scheduler, StepOutcome
from pdserve.engine.step import RankResult, SampleSpec, StepPlan
from pdserve.model.errors import CapacityError, InvalidRequestError

PAGE = 4


def scheduler(num_pages=16, max_running=8) -> Scheduler:
    return Scheduler(
        PageAllocator(num_pages), PAGE, 64, 16, 100, 1000, {1}, max_running=max_running,
        worker_kind="decode worker",
    )  # fmt: skip


def prefill_scheduler(num_pages=64, token_budget=10, max_chunk=6, fixed_chunks=False) -> Scheduler:
    return Scheduler(
        PageAllocator(num_pages), PAGE, token_budget, max_chunk, 100, 1000, {1},
        fixed_chunks=fixed_chunks, worker_kind="prefill worker",
    )  # fmt: skip


def request(rid, n, max_tokens=8, policy=Policy.DECODE_ONLY, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, seed=0, **kw)
    return Request(rid, list(range(3, 3 + n)), params, policy)


def finish(s: Scheduler, plan: StepPlan, token: int = 20) -> StepOutcome:
    """Finishes `plan` as a runner would: `token` for every row that samples."""
    (rank,) = plan.ranks
    result = RankResult(
        plan.step_id,
        [token if row.sample is not None else None for row in rank.prefill],
        [token] * len(rank.decode),
    )
    return s.finish_step(plan, [result])


def decode_ids(plan: StepPlan | None) -> list[str]:
    return [] if plan is None else [row.request_id for row in plan.ranks[0].decode]


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(row.request_id, row.start, len(row.token_ids)) for row in plan.ranks[0].prefill]


def test_scheduler_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdserve.engine.scheduler, pdserve.engine.step, pdserve.engine.pages\n"
        "import pdserve.prefill.config, pdserve.decode.config\n"
        "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# Decode-only.


def test_admission_kv_arrival_and_decode_until_length():
    s = scheduler()
    req = request("a", 5, max_tokens=3)
    s.add(req)
    assert req.state is RequestState.WAITING_FOR_KV and len(req.pages) == 2
    assert s.schedule() == (None, [])  # nothing runs before its KV arrives
    (out,) = s.kv_arrived(req.transfer_id, 5, first_token=42)
    assert out.token_ids == [42] and out.finish_reason is None
    plan, _ = s.schedule()
    (row,) = plan.ranks[0].decode
    assert (row.request_id, row.token_id, row.position) == ("a", 42, 5)
    assert row.page_ids == req.pages and len(req.pages) == 2  # 6 tokens fit 2 pages of 4
    assert row.sample == SampleSpec.of(req.params, 1) and row.sample.seed == 0
    assert finish(s, plan, 43).outputs[0].finish_reason is None
    plan, _ = s.schedule()
    assert len(req.pages) == 2 and plan.ranks[0].decode[0].position == 6
    (out,) = finish(s, plan, 44).outputs
    assert out.finish_reason == "length" and s.allocator.num_used == 0
    assert req.state is RequestState.FINISHED and req.token_ids[5:] == [42, 43, 44]


def test_eos_on_first_token_finishes_at_arrival():
    s = scheduler()
    req = request("a", 3)
    s.add(req)
    (out,) = s.kv_arrived(req.transfer_id, 3, first_token=1)
    assert out.finish_reason == "stop" and s.allocator.num_used == 0


def test_kv_for_the_wrong_token_count_aborts():
    s = scheduler()
    req = request("a", 3)
    s.add(req)
    (out,) = s.kv_arrived(req.transfer_id, 4, first_token=5)
    assert out.finish_reason == "abort" and "4 tokens" in out.error and s.allocator.num_used == 0


def test_validation_and_capacity():
    s = scheduler(num_pages=4, max_running=2)
    with pytest.raises(InvalidRequestError) as e:
        s.add(request("a", 0))
    assert str(e.value) == "prompt_token_ids: is empty"
    with pytest.raises(InvalidRequestError) as e:
        s.add(Request("b", [5, 200], SamplingParams(seed=0), Policy.DECODE_ONLY))
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(CapacityError, match="this decode worker has 4"):  # 17 + 8 never fit 4 pages
        s.add(request("c", 17))
    with pytest.raises(InvalidRequestError) as e:
        s.add(request("c", 4, max_tokens=997))
    assert e.value.field == "max_tokens"
    s.add(request("d", 8))
    s.add(request("e", 4))
    with pytest.raises(CapacityError, match="decode worker full"):  # pages all taken right now
        s.add(request("f", 4))
    with pytest.raises(InvalidRequestError) as e:
        s.add(request("d", 1))
    assert e.value.field == "request_id" and "already running" in str(e.value)


def run_until_preemption(s: Scheduler, token: int = 20) -> tuple[StepPlan, list[RequestOutput]]:
    """Steps until one plan preempts something; returns that plan and its outputs."""
    before = s.num_preemptions
    for _ in range(50):
        plan, outputs = s.schedule()
        if s.num_preemptions > before:
            return plan, outputs
        finish(s, plan, token)
    raise AssertionError("no preemption")


def speculating(num_pages=32) -> Scheduler:
    """A decode worker's scheduler that verifies up to two drafts a step."""
    return Scheduler(
        PageAllocator(num_pages), PAGE, 64, 16, 100, 1000, {1}, max_running=8,
        worker_kind="decode worker", num_drafts=2,
    )  # fmt: skip


def verify_step(s: Scheduler, tokens: list[int], kept: int, drafts: list[int]) -> StepOutcome:
    """Runs one step of a lone request whose drafts are verified: the runner's `tokens` per row, `kept` of
    them kept, `drafts` proposed after the last one kept."""
    plan, _ = s.schedule()
    rows = len(plan.ranks[0].decode)
    accepted = [kept] + [0] * (rows - 1) if rows > 1 else []
    proposed = [drafts if r == max(kept - 1, 0) else [] for r in range(rows)]
    result = RankResult(plan.step_id, [], tokens[:rows], decode_accepted=accepted,
                        decode_drafts=proposed)  # fmt: skip
    return s.finish_step(plan, [result])


def test_verify_groups_count_drafts_accepted_and_verifying_steps():
    s = speculating()
    req = request("a", 5, max_tokens=8)
    s.add(req)
    s.kv_arrived(req.transfer_id, 5, first_token=42, draft_ids=[50, 51])
    verify_step(s, [50, 52, 0], kept=2, drafts=[60, 61])  # the first draft accepted, the second not
    assert req.spec_counts() == SpecCounts(2, 1, 1)
    verify_step(s, [70, 0, 0], kept=1, drafts=[80, 81])  # both rejected
    (out,) = verify_step(s, [80, 81, 82], kept=3, drafts=[90]).outputs  # both accepted
    assert out.finish_reason is None and out.spec is None  # only an ending output carries them
    assert req.num_generated == 7
    (out,) = verify_step(s, [90], kept=1, drafts=[]).outputs  # one token left: no draft verified
    assert out.finish_reason == "length" and req.token_ids[5:] == [42, 50, 52, 70, 80, 81, 82, 90]
    assert out.spec == SpecCounts(6, 3, 3) and out.spec.mean_accepted_length == 2.0
    stats = s.spec_stats
    assert (stats.steps, stats.drafted, stats.accepted) == (3, 6, 3)
    assert stats.accepted_per_position == [2, 1]  # the second draft was accepted once
    assert stats.totals() == SpecCounts(6, 3, 3)
    assert scheduler().spec_stats.totals() is None  # a scheduler that does not speculate


def test_an_output_ending_a_stay_otherwise_carries_its_speculation():
    s = speculating()
    aborted, plain = request("a", 5, max_tokens=8), request("b", 5, max_tokens=8)
    s.add(aborted)
    s.add(plain)
    s.kv_arrived(aborted.transfer_id, 5, first_token=42, draft_ids=[50, 51])
    s.kv_arrived(plain.transfer_id, 5, first_token=43)  # no drafts: it verifies none
    plan, _ = s.schedule()
    assert [row.request_id for row in plan.ranks[0].decode] == ["a", "a", "a", "b"]
    result = RankResult(plan.step_id, [], [50, 51, 52, 60], decode_accepted=[3, 0, 0, 1],
                        decode_drafts=[[], [], [], []])  # fmt: skip
    s.finish_step(plan, [result])
    assert s.abort("a")[0].spec == SpecCounts(2, 2, 1)
    assert s.abort("b")[0].spec is None


def accept_all(s: Scheduler, plan: StepPlan) -> StepOutcome:
    """Finishes `plan` as a runner would that accepts every draft and proposes two more."""
    rows = plan.ranks[0].decode
    accepted, drafts = [0] * len(rows), [[] for _ in rows]
    first = 0
    for i, row in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1].request_id != row.request_id:  # a group's last row
            accepted[first], drafts[i] = i + 1 - first, [30, 30]
            first = i + 1
    result = RankResult(plan.step_id, [], [30] * len(rows), decode_accepted=accepted,
                        decode_drafts=drafts)  # fmt: skip
    return s.finish_step(plan, [result])


def test_a_preempted_decode_only_request_reports_its_speculation():
    s = speculating(num_pages=7)  # both fit two steps of three tokens, not the third
    old, new = request("old", 4, max_tokens=20), request("new", 4, max_tokens=20)
    for r in (old, new):
        s.add(r)
        s.kv_arrived(r.transfer_id, 4, first_token=30, draft_ids=[30, 30])
    for _ in range(2):
        plan, outputs = s.schedule()
        assert not outputs and len(plan.ranks[0].decode) == 6
        accept_all(s, plan)
    _, outputs = s.schedule()
    (out,) = outputs
    assert out.request_id == "new" and out.preempted and out.spec == SpecCounts(4, 4, 2)


def test_preemption_takes_the_newest_and_reports_it():
    s = scheduler(num_pages=6)  # 24 tokens: each request alone fits, both together do not
    old, new = request("old", 4, max_tokens=20), request("new", 4, max_tokens=20)
    s.add(old)
    s.add(new)
    s.kv_arrived(old.transfer_id, 4, 10)
    s.kv_arrived(new.transfer_id, 4, 11)
    plan, outputs = run_until_preemption(s)
    assert decode_ids(plan) == ["old"]
    (out,) = outputs
    assert out.request_id == "new" and out.preempted and "new" not in s.requests
    assert new.state is RequestState.ABORTED
    assert len(old.pages) == 4 and s.allocator.num_used == 4


def test_abort_frees_pages_in_every_state():
    s = scheduler()
    waiting, running = request("w", 5), request("r", 5)
    s.add(waiting)
    s.add(running)
    s.kv_arrived(running.transfer_id, 5, 9)
    plan, _ = s.schedule()
    for rid in ("w", "r"):
        (out,) = s.abort(rid)
        assert out.finish_reason == "abort"
    assert s.allocator.num_used == 0 and s.kv_arrived(waiting.transfer_id, 5, 9) == []
    free = s.allocator.num_free
    assert finish(s, plan).outputs == [], "an aborted request's row is skipped"
    assert s.allocator.num_free > free, "pages freed during the step come back after it"


def test_a_failed_pass_aborts_its_requests_only():
    s = scheduler()
    a, b = request("a", 4, policy=Policy.AGGREGATED), request("b", 4)
    s.add(a)
    s.add(b)
    s.kv_arrived(b.transfer_id, 4, 7)
    plan, _ = s.schedule()
    assert chunks(plan) == [("a", 0, 4)] and decode_ids(plan) == ["b"]
    result = RankResult(plan.step_id, [], [8], prefill_error="out of memory")
    (aborted, decoded) = s.finish_step(plan, [result]).outputs
    assert aborted == RequestOutput("a", [], "abort", "prefill failed: out of memory")
    assert decoded == RequestOutput("b", [8]) and s.allocator.num_used == 2


# Aggregated.


def test_local_prefill_preemption_requeues_without_output():
    s = scheduler(num_pages=6)
    a = request("a", 4, max_tokens=20, policy=Policy.AGGREGATED)
    b = request("b", 4, max_tokens=20, policy=Policy.AGGREGATED)
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    assert chunks(plan) == [("a", 0, 4), ("b", 0, 4)]
    assert [row.sample.step for row in plan.ranks[0].prefill] == [0, 0]
    outcome = s.finish_step(plan, [RankResult(plan.step_id, [50, 60])])
    assert [o.token_ids for o in outcome.outputs] == [[50], [60]] and outcome.to_send == []
    assert a.state is b.state is RequestState.RUNNING
    plan, outputs = run_until_preemption(s)
    assert decode_ids(plan) == ["a"] and outputs == [] and b.state is RequestState.WAITING
    assert not b.pages and not s.can_admit(1), "a preempted request goes before new ones"
    generated = b.num_generated
    finish(s, plan)
    s.abort("a")
    plan, _ = s.schedule()  # b is back: prompt and generated tokens prefilled again
    assert chunks(plan) == [("b", 0, 4 + generated)]
    assert plan.ranks[0].prefill[0].token_ids == b.token_ids
    assert plan.ranks[0].prefill[0].sample.step == generated


def test_replay_generated_prefills_the_prompt_and_replays_the_rest_as_decode_rows():
    """Batch-invariant mode: a request that comes with generated tokens (moved from a lost worker) computes
    each token in the phase that made it first: its prompt in prefill rows, its generated tokens in decode rows
    that feed the known tokens and drop their samples, the last of them sampling the next token for real."""
    s = Scheduler(
        PageAllocator(16), PAGE, 64, 16, 100, 1000, {1}, worker_kind="decode worker",
        replay_generated=True,
    )  # fmt: skip
    moved = Request("m", [3, 4, 5, 6, 7, 40, 41, 42], SamplingParams(max_tokens=8, seed=0,
                    frequency_penalty=0.5), Policy.AGGREGATED, num_generated=3)  # fmt: skip
    fresh = request("f", 5, policy=Policy.AGGREGATED)
    s.add(moved)
    s.add(fresh)
    assert s.queued_tokens == 5 + 5
    plan, _ = s.schedule()
    assert chunks(plan) == [("m", 0, 5), ("f", 0, 5)]
    assert [row.sample is None for row in plan.ranks[0].prefill] == [True, False]
    outcome = finish(s, plan, token=50)
    assert [(o.request_id, o.token_ids) for o in outcome.outputs] == [("f", [50])]
    assert moved.state is RequestState.RUNNING and moved.num_computed == 5
    fed = []
    for _ in range(2):  # positions 5 and 6 replay tokens 40 and 41; their samples are dropped
        plan, _ = s.schedule()
        row = plan.ranks[0].decode[0]
        assert (
            row.request_id == "m" and row.sample.temperature == 0 and row.sample.penalty_ids is None
        )
        fed.append((row.position, row.token_id))
        outcome = finish(s, plan, token=99)
        assert [o.request_id for o in outcome.outputs] == ["f"]
    assert fed == [(5, 40), (6, 41)] and moved.token_ids == [3, 4, 5, 6, 7, 40, 41, 42]
    plan, _ = (
        s.schedule()
    )  # the last known token samples the next one, step 3, with its whole sequence
    row = plan.ranks[0].decode[0]
    assert (row.position, row.token_id, row.sample.step) == (7, 42, 3)
    assert row.sample.penalty_ids == (3, 4, 5, 6, 7, 40, 41, 42)
    outcome = finish(s, plan, token=60)
    assert ("m", [60]) in [(o.request_id, o.token_ids) for o in outcome.outputs]
    assert moved.num_computed == 8 and moved.token_ids[-1] == 60
    # without replay (the default) the same request is prefilled whole and samples at once
    s = scheduler()
    again = Request("m", [3, 4, 5, 6, 7, 40, 41, 42], SamplingParams(max_tokens=8, seed=0),
                    Policy.AGGREGATED, num_generated=3)  # fmt: skip
    s.add(again)
    plan, _ = s.schedule()
    assert chunks(plan) == [("m", 0, 8)] and plan.ranks[0].prefill[0].sample.step == 3


def test_outputs_carry_the_stages_the_request_ran():
    """A finishing output carries the stages the request ran here; a request whose KV came from a prefill
    worker has that worker's stages (and its first token's log-probabilities) from its first output on."""
    s = scheduler()
    local = request("a", 4, max_tokens=2, policy=Policy.AGGREGATED)  # prefilled and decoded here
    remote = request("d", 4, max_tokens=2, logprobs=1)  # its KV comes from a prefill worker
    s.add(local)
    s.add(remote)
    plan, _ = s.schedule()
    on_prefill = StageTimes(prefill_queue_s=0.25, prefill_s=0.5, kv_transfer_s=0.125)
    first_logprobs = TokenLogprobs(-0.5, (9,), (-0.5,))
    outputs = finish(s, plan).outputs + s.kv_arrived(
        remote.transfer_id, 4, 9, first_logprobs, on_prefill
    )
    assert [o.request_id for o in outputs] == ["a", "d"]
    assert outputs[0].stages is None  # not finished
    assert outputs[1].stages == on_prefill and outputs[1].logprobs == [first_logprobs]
    plan, _ = s.schedule()
    stages = {o.request_id: o.stages for o in finish(s, plan).outputs}
    a, d = stages["a"], stages["d"]
    assert (
        a.prefill_queue_s > 0 and a.prefill_s > 0 and a.decode_queue_s > 0 and a.kv_transfer_s == 0
    )
    assert d == dataclasses.replace(on_prefill, decode_queue_s=d.decode_queue_s)
    assert d.decode_queue_s > 0


def test_a_penalized_request_s_sequence_goes_once_per_stay_on_a_runner():
    s = scheduler(num_pages=6)
    a = request("a", 4, max_tokens=20, policy=Policy.AGGREGATED, frequency_penalty=0.5)
    b = request("b", 4, max_tokens=20, policy=Policy.AGGREGATED, repetition_penalty=1.2)
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    assert [r.sample.penalty_ids for r in plan.ranks[0].prefill] == [(3, 4, 5, 6)] * 2
    finish(s, plan)
    plan, _ = s.schedule()
    assert [r.sample.penalty_ids for r in plan.ranks[0].decode] == [None, None]  # counted there
    finish(s, plan)
    plan, _ = run_until_preemption(s)
    assert b.state is RequestState.WAITING and not b.counted
    finish(s, plan)
    s.abort("a")
    plan, _ = s.schedule()  # prefilled again: its whole sequence goes again
    assert plan.ranks[0].prefill[0].sample.penalty_ids == tuple(b.token_ids)
    # a decode-only request: its first decode row after its KV arrived carries the sequence
    c = request("c", 4, presence_penalty=1.0)
    s.add(c)
    s.kv_arrived(c.transfer_id, 4, 9)
    finish(s, plan)
    plan, _ = s.schedule()
    (row,) = [r for r in plan.ranks[0].decode if r.request_id == "c"]
    assert row.sample.penalty_ids == (3, 4, 5, 6, 9)


def test_long_prompts_are_prefilled_in_chunks_then_decoded():
    s = scheduler()
    a = request("a", 20, max_tokens=2, policy=Policy.AGGREGATED)  # max_chunk 16
    s.add(a)
    plan, _ = s.schedule()
    (row,) = plan.ranks[0].prefill
    assert (row.start, len(row.token_ids), row.sample) == (0, 16, None)
    assert finish(s, plan).outputs == [] and a.num_computed == 16
    plan, _ = s.schedule()
    assert chunks(plan) == [("a", 16, 4)] and plan.ranks[0].prefill[0].sample is not None
    (out,) = finish(s, plan, 30).outputs
    assert out.token_ids == [30] and a.state is RequestState.RUNNING
    plan, _ = s.schedule()
    assert decode_ids(plan) == ["a"] and chunks(plan) == []
    (out,) = finish(s, plan, 31).outputs
    assert out.finish_reason == "length" and s.allocator.num_used == 0


# Prefill-only.


def prefill_request(rid: str, n: int) -> Request:
    return request(rid, n, policy=Policy.PREFILL_ONLY)


def test_budget_and_chunks():
    s = prefill_scheduler()
    for rid, n in (("a", 9), ("b", 3), ("c", 5)):
        s.add(prefill_request(rid, n))
    assert s.queued_tokens == 17
    plan, _ = s.schedule()
    rows = plan.ranks[0].prefill
    assert [(r.request_id, r.start, len(r.token_ids), r.sample is not None) for r in rows] == [
        ("a", 0, 6, False), ("b", 0, 3, True), ("c", 0, 1, False),
    ]  # fmt: skip
    outcome = finish(s, plan, 77)
    assert [(r.request_id, t) for r, t, _ in outcome.to_send] == [
        ("b", 77)
    ] and outcome.outputs == []
    assert s.requests["b"].state is RequestState.SENDING
    plan, _ = s.schedule()
    assert chunks(plan) == [("a", 6, 3), ("c", 1, 4)]
    assert plan.ranks[0].prefill[1].token_ids == s.requests["c"].token_ids[1:]
    assert [r.request_id for r, _, _ in finish(s, plan).to_send] == ["a", "c"]
    assert s.queued_tokens == 0 and s.allocator.num_used == 3 + 1 + 2
    for rid in "abc":
        s.release(rid)
    assert s.allocator.num_used == 0 and not s.requests


def test_fixed_chunks_cut_prompts_only_at_chunk_multiples():
    """Batch-invariant mode: "c" is not cut where the budget ran out; it waits for the next step."""
    s = prefill_scheduler(fixed_chunks=True)
    for rid, n in (("a", 9), ("b", 3), ("c", 5)):
        s.add(prefill_request(rid, n))
    steps = []
    while s.queued_tokens:
        plan, _ = s.schedule()
        steps.append(chunks(plan))
        finish(s, plan)
    assert steps == [[("a", 0, 6), ("b", 0, 3)], [("a", 6, 3), ("c", 0, 5)]]


def test_pages_wait_at_the_head_of_the_line():
    s = prefill_scheduler(num_pages=4, token_budget=100, max_chunk=100)
    s.add(prefill_request("a", 12))
    s.add(prefill_request("b", 8))  # needs 2 pages, only 1 left after a
    s.add(prefill_request("c", 1))
    plan, _ = s.schedule()
    assert [r for r, _, _ in chunks(plan)] == ["a"], "b blocks c: first come first served"
    assert s.requests["b"].state is RequestState.WAITING and not s.requests["b"].pages
    finish(s, plan)
    s.release("a")
    plan, _ = s.schedule()
    assert [r for r, _, _ in chunks(plan)] == ["b", "c"]


def test_a_prompt_that_can_never_fit_is_refused():
    s = prefill_scheduler(num_pages=2)
    with pytest.raises(CapacityError, match="need 3 KV pages; this prefill worker has 2"):
        s.add(prefill_request("a", 9))
    s.add(prefill_request("b", 1))
    with pytest.raises(InvalidRequestError, match="already queued"):
        s.add(prefill_request("b", 1))


def test_abort_while_prefilling_skips_its_rows():
    s = prefill_scheduler()
    s.add(prefill_request("a", 9))
    plan, _ = s.schedule()
    (out,) = s.abort("a")
    assert out.finish_reason == "abort" and s.allocator.num_used == 0
    assert finish(s, plan) == StepOutcome([], [])


# The plan on the wire.


def test_plan_and_result_round_trip_through_msgpack():
    s = scheduler()
    a = request("a", 6, policy=Policy.AGGREGATED, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    b = Request("b", [3, 4, 5], SamplingParams(seed=2**63 - 1), Policy.DECODE_ONLY)
    s.add(a)
    s.add(b)
    s.kv_arrived(b.transfer_id, 3, 9)
    plan, _ = s.schedule()
    assert chunks(plan) == [("a", 0, 6)] and decode_ids(plan) == ["b"]
    assert plan_from_wire(msgpack.unpackb(msgpack.packb(plan_to_wire(plan)))) == plan
    assert plan.ranks[0].prefill[0].sample == SampleSpec(0.7, 0.9, 5, 0.1, 0, 0)
    result = RankResult(plan.step_id, [11], [], decode_error="device lost")
    assert result_from_wire(msgpack.unpackb(msgpack.packb(result_to_wire(result)))) == result


def test_relaxed_rows_are_the_verify_rows_inside_the_think_block():
    """A request that opted in, its prompt ending inside <think> (id 7, closed by 8): its verify row and the
    draft rows before the draft that closes the block judge relaxed; the rows after it strict. Without the
    server's relaxed setting, or for a request that did not opt in, no row is relaxed."""
    from pdserve.engine.sampling_params import SamplingParams

    def rows_of(relaxed, think_ids):
        s = Scheduler(PageAllocator(16), 4, 64, 64, 100, 1000, [], num_drafts=3, relaxed=relaxed)
        params = SamplingParams(max_tokens=20, ignore_eos=True, seed=0, relaxed_think_ids=think_ids)
        r = Request("a", [1, 2, 7, 3], params, Policy.AGGREGATED)
        s.add(r)
        plan, _ = s.schedule()
        s.finish_step(plan, [RankResult(plan.step_id, [5], prefill_drafts=[[6]])])
        r.draft_ids = [9, 8, 4]  # the second draft closes the block
        plan, _ = s.schedule()
        return [row.sample.relaxed for row in plan.ranks[0].decode]

    assert rows_of((10, 0.5), (7, 8)) == [True, True, False, False]
    assert rows_of(None, (7, 8)) == [False] * 4
    assert rows_of((10, 0.5), None) == [False] * 4


def test_a_constrained_request_verifies_its_drafts_and_sends_its_grammar_once():
    grammar = StructuredOutput("regex", "[a-z]+")
    s = speculating()
    req = request("a", 5, max_tokens=8, structured=grammar)
    s.add(req)
    s.kv_arrived(req.transfer_id, 5, first_token=42, draft_ids=[50, 51])
    plan, _ = s.schedule()
    row, *draft_rows = plan.ranks[0].decode  # the runner masks the drafts' rows too
    assert row.drafts == 2 and row.sample.constrained
    assert row.sample.grammar == grammar and row.sample.grammar_ids == (42,)
    assert all(r.sample.constrained and r.sample.grammar is None for r in draft_rows)
    s.finish_step(plan, [RankResult(plan.step_id, [], [43, 0, 0], decode_accepted=[1, 0, 0])])
    plan, _ = s.schedule()
    (row,) = plan.ranks[0].decode
    assert row.sample.constrained and row.sample.grammar is None  # the runner keeps its matcher
    result = RankResult(plan.step_id, [], [44], row_errors={"a": "structured output failed: x"})
    (out,) = s.finish_step(plan, [result]).outputs
    assert out.finish_reason == "abort" and out.error == "structured output failed: x"
