"""`SpecPolicy`: a step drafts while the busiest rank runs at most max_batch requests and the running acceptance
stays at or above min_acceptance; switched off by acceptance, it probes with two drafting steps now and then."""

from __future__ import annotations

import pytest

from pdserve.engine.spec_policy import SpecPolicy


def test_drafts_up_to_the_batch_limit():
    policy = SpecPolicy(3, max_batch=32)
    assert policy.drafts_for_step(1) == 3 and policy.drafts_for_step(32) == 3
    assert policy.drafts_for_step(33) == 0
    assert SpecPolicy(0).drafts_for_step(1) == 0
    assert SpecPolicy(2).drafts_for_step(10**6) == 2


def test_low_acceptance_switches_drafting_off_and_probes_bring_it_back():
    policy = SpecPolicy(2, min_acceptance=0.4, probe_every=8)
    policy.verified(10, 1)  # 0.1
    on = [policy.drafts_for_step(4) for _ in range(24)]
    # off, except two steps in every eight (one proposes, the next verifies)
    assert on.count(2) == 6 and on.count(0) == 18
    for _ in range(40):
        policy.verified(10, 9)
    assert policy.acceptance >= 0.4
    assert [policy.drafts_for_step(4) for _ in range(4)] == [2] * 4


def test_acceptance_is_a_running_average_and_steps_without_drafts_leave_it():
    policy = SpecPolicy(1, smoothing=0.5)
    policy.verified(4, 4)
    policy.verified(0, 0)
    policy.verified(4, 0)
    assert policy.acceptance == pytest.approx(0.5)
    with pytest.raises(ValueError, match="min_acceptance"):
        SpecPolicy(1, min_acceptance=1.5)
