"""The step plan and rank results on the wire (`pdserve.engine.ranks.wire`), through msgpack as a plan channel carries
them: every field of every row kind comes back equal (prefill rows with and without a sample, decode rows, empty
ranks, several ranks, a rank repeating another's rows), with and without the driver's page-table cache, whose
remembered page ids never stand in for changed ones; the wire is raw buffers, not per-value objects; a rank's
rows stay arrays until read; a malformed wire is refused with the field named."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from pdserve.engine.ranks.channel import decode, encode
from pdserve.engine.ranks.wire import (
    PageTableCache,
    WireRows,
    max_pages,
    plan_from_wire,
    plan_to_wire,
    prefill_tokens,
    result_from_wire,
    result_to_wire,
)
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.step import (
    NO_LOGPROBS,
    DecodeRow,
    PrefillRow,
    RankResult,
    RankStep,
    SampleSpec,
    StepPlan,
)


def over_the_wire(plan: StepPlan, cache: PageTableCache | None = None) -> StepPlan:
    return plan_from_wire(decode(encode(plan_to_wire(plan, cache))))


def random_sample(rng: random.Random) -> SampleSpec:
    return SampleSpec(
        temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.random(), top_k=rng.choice([-1, 1, 50]),
        relaxed=rng.random() < 0.3,
        min_p=rng.random() / 3, seed=rng.randrange(2**63), step=rng.randrange(10_000),
    )  # fmt: skip


def random_pages(rng: random.Random) -> list[int]:
    return rng.sample(range(1 << 20), rng.randrange(1, 70))


def random_rank(rng: random.Random, prefill: int, decode: int) -> RankStep:
    return RankStep(
        [
            PrefillRow(
                f"p{rng.randrange(10**6)}",
                [rng.randrange(129_280) for _ in range(rng.randrange(1, 40))],
                rng.randrange(5000),
                random_pages(rng),
                random_sample(rng) if rng.random() < 0.5 else None,
                rng.randrange(129_280) if rng.random() < 0.5 else None,
            )  # fmt: skip
            for _ in range(prefill)
        ],
        [
            DecodeRow(
                f"d{rng.randrange(10**6)}",
                rng.randrange(129_280),
                rng.randrange(1 << 17),
                random_pages(rng),
                random_sample(rng),
                rng.randrange(5),
            )  # fmt: skip
            for _ in range(decode)
        ],
    )


def assert_same_plan(got: StepPlan, want: StepPlan) -> None:
    """Field by field (a failure names the field), then as wholes."""
    assert got.step_id == want.step_id and len(got.ranks) == len(want.ranks)
    for got_rank, want_rank in zip(got.ranks, want.ranks, strict=True):
        for passes in ("prefill", "decode"):
            got_rows, want_rows = getattr(got_rank, passes), getattr(want_rank, passes)
            assert len(got_rows) == len(want_rows)
            for got_row, want_row in zip(got_rows, want_rows, strict=True):
                assert type(got_row) is type(want_row)
                for field in type(want_row).__slots__:
                    assert getattr(got_row, field) == getattr(want_row, field), (passes, field)
                    assert type(getattr(got_row, field)) is type(getattr(want_row, field))
    assert got == want


@pytest.mark.parametrize("seed", range(5))
def test_random_plans_of_several_ranks_round_trip(seed):
    rng = random.Random(seed)
    ranks = [
        random_rank(rng, rng.randrange(4), rng.randrange(6)) for _ in range(rng.randrange(1, 5))
    ]
    plan = StepPlan(
        rng.randrange(1 << 40),
        ranks,
        seed % 2 == 1,
        rng.randrange(5),
        rng.randrange(8),
        rng.random(),
    )
    assert_same_plan(over_the_wire(plan), plan)


def test_every_row_kind_and_empty_ranks_round_trip():
    sample = SampleSpec(0.7, 0.9, 5, 0.1, 2**63 - 1, 3)
    prefill = [
        PrefillRow("first chunk", [1, 2, 3], 0, [7, 8], None),
        PrefillRow("last chunk", [129_279], 64, [9, 10, 11], sample),
        PrefillRow("whole prompt", [5, 6], 0, [2**31 - 1], SampleSpec(0.0, 1.0, -1, 0.0, 0, 0)),
    ]
    decode_rows = [DecodeRow("d", 42, 4095, list(range(64)), sample)]
    plan = StepPlan(
        -3,
        [
            RankStep(prefill, decode_rows),
            RankStep(),
            RankStep(decode=decode_rows),
            RankStep(prefill),
        ],
    )
    got = over_the_wire(plan)
    assert_same_plan(got, plan)
    assert got.ranks[1].is_empty and not got.ranks[2].prefill and not got.ranks[3].decode
    assert got.ranks[0].prefill[0].sample is None and got.ranks[0].prefill[1].sample == sample
    assert [r.request_id for r in got.ranks[0].prefill] == [
        "first chunk",
        "last chunk",
        "whole prompt",
    ]
    assert over_the_wire(StepPlan(0, [])) == StepPlan(0, [])


def test_the_wire_is_raw_buffers():
    rng = random.Random(7)
    plan = StepPlan(1, [random_rank(rng, 2, 64), random_rank(rng, 1, 64)])

    def leaves(value):
        if isinstance(value, list):
            for v in value:
                yield from leaves(v)
        else:
            yield value

    wire = plan_to_wire(plan)
    values = list(leaves(wire))
    prefill = [r for rank in plan.ranks for r in rank.prefill]
    decode_rows = [r for rank in plan.ranks for r in rank.decode]
    # the step id, one string per row, and per rank and pass a fixed number of buffers, one page-id size and
    # the sampling extras (None: plain samples pay nothing for penalties or log-probabilities), then the
    # plan's mtp flag, draft count and relaxed acceptance (top-k, delta)
    assert sum(isinstance(v, bytes) for v in values) == 2 * (6 + 4)
    assert sum(v is None for v in values) == 2 * 2
    assert len(values) == 1 + len(prefill) + len(decode_rows) + 2 * (6 + 4 + 2 + 2) + 4
    page_ids = sum(len(r.page_ids) for r in [*prefill, *decode_rows])
    sampled = sum(r.sample is not None for r in prefill)
    buffers = (
        4 * page_ids + 16 * (len(prefill) + len(decode_rows))  # page ids, 4 int32 a row
        + len(prefill) + 4 * sum(len(r.token_ids) for r in prefill)  # sample flags, chunk tokens
        + 56 * (sampled + len(decode_rows))  # 3 float64 and 4 int64 a sample
    )  # fmt: skip
    assert sum(len(v) for v in values if isinstance(v, bytes)) == buffers


def test_a_rank_repeating_another_s_rows_is_sent_once_and_read_once():
    rng = random.Random(3)
    shared, other = random_rank(rng, 1, 8), random_rank(rng, 0, 3)
    plan = StepPlan(5, [shared, other, shared, shared])
    wire = plan_to_wire(plan)
    assert wire[1][2] == 0 and wire[1][3] == 0
    alone = len(encode(plan_to_wire(StepPlan(5, [shared, other]))))
    assert len(encode(wire)) < alone + 8
    got = plan_from_wire(decode(encode(wire)))
    assert_same_plan(got, plan)
    assert got.ranks[0] is got.ranks[2] is got.ranks[3] and got.ranks[1] is not got.ranks[0]
    # equal but distinct steps are each sent
    copy = RankStep(list(shared.prefill), list(shared.decode))
    assert isinstance(plan_to_wire(StepPlan(6, [shared, copy]))[1][1], list)


def test_rows_stay_arrays_until_read():
    rng = random.Random(11)
    plan = StepPlan(2, [random_rank(rng, 3, 5)])
    got = over_the_wire(plan).ranks[0]
    assert isinstance(got.decode, WireRows) and isinstance(got.prefill, WireRows)
    assert got.decode._rows is None and len(got.decode) == 5 and got.decode._rows is None
    want = plan.ranks[0].decode
    assert got.decode.token_ids.tolist() == [r.token_id for r in want]
    assert got.decode.positions.tolist() == [r.position for r in want]
    assert got.decode.page_counts.tolist() == [len(r.page_ids) for r in want]
    assert got.decode.page_ids.tolist() == [p for r in want for p in r.page_ids]
    assert got.prefill.token_counts.tolist() == [len(r.token_ids) for r in plan.ranks[0].prefill]
    assert got.decode._rows is None
    assert got.decode[1] == want[1] and got.decode[-2:] == want[-2:]
    assert got.decode[0] is got.decode[0]  # made once


def test_pass_sizes_come_from_the_wire_without_row_objects():
    rng = random.Random(12)
    plan = StepPlan(3, [random_rank(rng, 3, 5), random_rank(rng, 0, 0)])
    got = over_the_wire(plan)
    for rank, want in zip(got.ranks, plan.ranks, strict=True):
        assert prefill_tokens(rank.prefill) == prefill_tokens(want.prefill)
        assert prefill_tokens(want.prefill) == sum(len(r.token_ids) for r in want.prefill)
        assert max_pages(rank.decode) == max_pages(want.decode)
        assert max_pages(want.decode) == max((len(r.page_ids) for r in want.decode), default=0)
        assert max_pages(rank.prefill) == max_pages(want.prefill)
    assert all(getattr(r.decode, "_rows", None) is None for r in got.ranks)


def test_cached_page_tables_follow_every_change():
    rng = random.Random(5)
    cache = PageTableCache(1 << 20)
    rows = {f"r{i}": random_pages(rng) for i in range(6)}
    sample = SampleSpec(0.0, 1.0, -1, 0.0, 1, 0)
    for step in range(40):
        for request_id, pages in rows.items():
            change = rng.random()
            if change < 0.2:
                pages.append(rng.randrange(1 << 20))  # a new page
            elif change < 0.3:
                pages[rng.randrange(len(pages))] = rng.randrange(1 << 20)  # preempted: other pages
            elif change < 0.35:
                rows[request_id] = pages = pages[:-1] or [0]
        if step % 7 == 3:  # a request leaves and another, under a reused id, comes back later
            rows.pop(next(iter(rows)))
            rows[f"r{step % 3}"] = random_pages(rng)
        decode_rows = [DecodeRow(i, 1, 2, list(p), sample) for i, p in rows.items()]
        prefill = [PrefillRow(i, [3], 0, list(p), None) for i, p in list(rows.items())[:2]]
        plan = StepPlan(
            step, [RankStep(prefill, decode_rows[2:]), RankStep(decode=decode_rows[:2])]
        )
        got = over_the_wire(plan, cache)
        assert_same_plan(got, plan)
        assert got == over_the_wire(plan)


def test_the_cache_is_not_fooled_by_a_list_changed_in_place():
    cache = PageTableCache(1 << 20)
    pages = [1, 2, 3]
    sample = SampleSpec(0.0, 1.0, -1, 0.0, 1, 0)
    plan = StepPlan(0, [RankStep(decode=[DecodeRow("a", 1, 2, pages, sample)])])
    over_the_wire(plan, cache)
    pages[1] = 9
    assert over_the_wire(plan, cache).ranks[0].decode[0].page_ids == [1, 9, 3]


@pytest.mark.parametrize(
    "result",
    [
        RankResult(7),
        RankResult(8, [11, None, 0, 129_279], [5, 6, 7]),
        RankResult(9, [None], [], decode_error="device lost"),
        RankResult(-1, [], [2**31 - 1], prefill_error="bad chunk", decode_error="also"),
        RankResult(
            10,
            [4, None, 6],
            [7, 8],
            prefill_logprobs=[TokenLogprobs(-0.5, (4, 9), (-0.5, -1.25)), None, None],
            decode_logprobs=[None, TokenLogprobs(-3.0)],
        ),  # fmt: skip
        RankResult(
            11,
            [4, None],
            [7, 8, 9, 1],
            decode_accepted=[2, 0, 0, 1],
            prefill_drafts=[[5], []],
            decode_drafts=[[], [3, 4, 5], [], [6, 7, 8]],
        ),  # fmt: skip
    ],
)
def test_results_round_trip(result):
    got = result_from_wire(decode(encode(result_to_wire(result))))
    assert got == result
    assert all(type(t) is int for t in got.decode_tokens)


def test_results_without_logprobs_pay_nothing_for_them():
    wire = result_to_wire(RankResult(1, [3, None], [5, 6]))
    assert wire[-2:] == [None, None]


def test_penalties_bans_and_logprobs_round_trip_only_where_asked():
    params = SamplingParams(
        max_tokens=9, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
        min_tokens=4, logprobs=3, stop_token_ids=(17, 5), seed=11,
    )  # fmt: skip
    tokens = [0, 40, 41, 42, 43, 44]
    full = SampleSpec.of(params, 2, tokens, eos_token_ids={1})
    assert full.penalty_ids == tuple(tokens) and full.banned_ids == (1, 5, 17)
    counted = SampleSpec.of(SamplingParams(frequency_penalty=1.0), 2, tokens, {1}, counted=True)
    assert counted.penalty_ids is None and counted.banned_ids == () and counted.penalized
    past_min = SampleSpec.of(dataclasses.replace(params, ignore_eos=True), 3, tokens, {1})
    assert past_min.banned_ids == (5, 17)
    assert SampleSpec.of(params, 4, tokens, {1}).banned_ids == ()
    plain = SampleSpec.of(SamplingParams(temperature=0.5, seed=3), 2, tokens, {1})
    assert plain.plain and plain.logprobs == NO_LOGPROBS and not full.plain
    plan = StepPlan(3, [RankStep(
        [PrefillRow("a", [1, 2], 0, [0], full), PrefillRow("b", [3], 0, [1], None)],
        [DecodeRow("c", 5, 9, [2], plain), DecodeRow("d", 6, 7, [3], counted)],
    ), RankStep([], [DecodeRow("e", 1, 1, [4], plain)])])  # fmt: skip
    got = over_the_wire(plan)
    assert got == plan
    assert got.ranks[0].prefill[0].sample.penalty_ids == tuple(tokens)
    assert got.ranks[0].decode[1].sample.penalty_ids is None
    assert got.ranks[1].decode.sample_extras is None  # a pass of plain samples has no extras


def test_a_malformed_wire_is_refused_naming_the_field():
    rng = random.Random(2)
    wire = decode(encode(plan_to_wire(StepPlan(1, [random_rank(rng, 2, 3)]))))
    prefill, decode_pass = wire[1][0]
    decode_pass[2][1] = decode_pass[2][1][:-4]
    with pytest.raises(ValueError, match="decode page ids"):
        plan_from_wire(wire)
    prefill[2] = prefill[2] + b"\0\0\0\0"
    with pytest.raises(ValueError, match="prefill token ids"):
        plan_from_wire([1, [[prefill, None]], False, 0, 0, 0.0])
    decode_pass[2] = [3, b"\0" * 3 * 6]
    with pytest.raises(ValueError, match="decode page ids of 3 bytes"):
        plan_from_wire([1, [[None, decode_pass]], False, 0, 0, 0.0])
    with pytest.raises(ValueError, match="rank 0 refers to rank 0"):
        plan_from_wire([1, [0], False, 0, 0, 0.0])
    sample = SampleSpec(0.0, 1.0, -1, 0.0, 1, 0)
    with pytest.raises(OverflowError):
        plan_to_wire(StepPlan(1, [RankStep(decode=[DecodeRow("a", 1, 2, [2**31], sample)])]))


def test_wire_rows_compare_like_lists():
    rng = random.Random(9)
    plan = StepPlan(2, [random_rank(rng, 1, 4)])
    got = over_the_wire(plan).ranks[0].decode
    want = plan.ranks[0].decode
    assert got == want and want == got and got == tuple(want) and got != want[:-1]
    assert got != "not rows" and list(got) == want and got.index(want[2]) == 2
    assert np.array_equal(got.sample_ints[2], [r.sample.step for r in want])


@pytest.mark.parametrize(
    ("num_pages", "bytes_per_page"), [(None, 4), (1, 2), (1 << 16, 2), ((1 << 16) + 1, 4)]
)
def test_page_ids_go_as_uint16_where_the_cache_allows(num_pages, bytes_per_page):
    sample = SampleSpec(0.0, 1.0, -1, 0.0, 1, 0)
    top = min(num_pages or 1 << 31, 1 << 31) - 1
    rows = [DecodeRow("a", 1, 2, [0, top, top // 2], sample), DecodeRow("b", 1, 2, [top], sample)]
    plan = StepPlan(0, [RankStep([PrefillRow("c", [1], 0, [top, 0], None)], rows)])
    cache = None if num_pages is None else PageTableCache(num_pages)
    wire = plan_to_wire(plan, cache)
    (prefill, decode_pass) = wire[1][0]
    assert decode_pass[2] == [bytes_per_page, decode_pass[2][1]] and prefill[3][0] == bytes_per_page
    assert len(decode_pass[2][1]) == 4 * bytes_per_page and len(prefill[3][1]) == 2 * bytes_per_page
    assert_same_plan(plan_from_wire(decode(encode(wire))), plan)


def test_a_page_id_the_cache_cannot_hold_is_refused():
    sample = SampleSpec(0.0, 1.0, -1, 0.0, 1, 0)
    for page in (1 << 16, -1):
        plan = StepPlan(0, [RankStep(decode=[DecodeRow("a", 1, 2, [page], sample)])])
        with pytest.raises(OverflowError):
            plan_to_wire(plan, PageTableCache(1 << 16))
    with pytest.raises(ValueError, match="num_pages=0"):
        PageTableCache(0)
