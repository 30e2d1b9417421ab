"""The worker's step timer (`pdserve.engine.step_timer`): what a step's work is, and that its expectation errs
long, never short: work weighed by context, buckets by work, a decayed maximum within each, bounds from the
nearest measured buckets."""

from __future__ import annotations

import pytest

from pdserve.engine.step import DecodeRow, PrefillRow, RankStep, SampleSpec, StepPlan
from pdserve.engine.step_timer import CONTEXT_TOKENS, DECAY, StepTimer, step_work

SAMPLE = SampleSpec(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)


def plan(
    prefill_tokens: list[int], decode_drafts: list[int], ranks: int = 1, start: int = 0,
    position: int = 0,
) -> StepPlan:  # fmt: skip
    step = RankStep(
        prefill=[
            PrefillRow(f"p{i}", [1] * n, start, [0], None) for i, n in enumerate(prefill_tokens)
        ],
        decode=[
            DecodeRow(f"d{i}", 1, position, [0], SAMPLE, drafts=k)
            for i, k in enumerate(decode_drafts)
        ],
    )
    return StepPlan(0, [step] + [RankStep()] * (ranks - 1))


def test_a_steps_work_is_its_busiest_ranks_tokens_weighed_by_their_context():
    short = 100 * (1 + 50 / CONTEXT_TOKENS) + 28 * (1 + 14 / CONTEXT_TOKENS)
    assert step_work(plan([100, 28], [0, 2])) == pytest.approx(short + 1 + 3)
    assert step_work(plan([64], [], ranks=4)) == pytest.approx(64 * (1 + 32 / CONTEXT_TOKENS))
    assert step_work(StepPlan(0, [])) == 0
    # the same chunk after a long cached prefix, a decode row deep in its context: more work
    assert step_work(plan([64], [], start=8 * CONTEXT_TOKENS)) > 8 * 64
    assert step_work(plan([], [0], position=4 * CONTEXT_TOKENS)) == pytest.approx(5)


def test_the_expectation_is_unknown_until_a_step_is_measured_then_scales_with_work():
    timer = StepTimer()
    assert timer.expected_s(64) == 0.0 and timer.current() == (0.0, 0.0)
    timer.measured(0.010, 1)  # a one-row decode step
    assert timer.expected_s(1) == pytest.approx(0.010)
    # a bigger step never measured: the small step's seconds per token, scaled up (long, never short)
    assert timer.expected_s(512) == pytest.approx(512 * 0.010)
    timer.measured(0.5, 512)
    assert timer.expected_s(512) == pytest.approx(0.5)
    assert timer.expected_s(700) == pytest.approx(700 * 0.5 / 512)  # the nearest smaller bucket
    assert timer.expected_s(1) == pytest.approx(0.010)  # buckets apart
    # a larger bucket measured: the time of its largest step bounds a smaller one's
    big = StepTimer()
    big.measured(1.0, 1000)  # bucket 10: up to 1024 tokens
    assert big.expected_s(8) == pytest.approx(1024 / 1000)
    big.measured(0.010, 1)  # and a smaller one: the lesser bound
    assert big.expected_s(8) == pytest.approx(8 * 0.010)
    assert big.expected_s(200) == pytest.approx(1024 / 1000)


def test_a_slow_step_raises_the_expectation_at_once_and_it_decays_after():
    timer = StepTimer()
    timer.measured(0.010, 1)
    timer.measured(1.0, 1)
    assert timer.expected_s(1) == pytest.approx(1.0)
    timer.measured(0.010, 1)
    assert timer.expected_s(1) == pytest.approx(DECAY)


def test_the_step_in_flight_reports_its_running_time_and_expectation():
    timer = StepTimer()
    step = plan([64], [])
    timer.measured(0.002, step_work(step))
    timer.started(step)
    ran, expected = timer.current()
    assert 0.0 < ran < 1.0 and expected == pytest.approx(0.002)
    timer.finished(step)
    assert timer.current() == (0.0, 0.0)
    before = dict(timer.seconds_per_token)
    timer.started(step)
    timer.finished(step, measure=False)  # a failed step: not a measure of speed
    assert timer.current() == (0.0, 0.0) and timer.seconds_per_token == before
