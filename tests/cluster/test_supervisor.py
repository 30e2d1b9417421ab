"""The supervisor without Ray: its restart budget (at most router.max_restarts replacements per role within
router.restart_window_s, counted per role, and the budget comes back as the window slides) and when it counts a
worker stalled (silent or stepping past its step's deadline, which scales with the step)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.cluster.supervisor import (
    STEP_DEADLINE_FACTOR,
    UNKNOWN_STEP_S,
    WATCH_S,
    Supervisor,
    stall_reason,
    step_deadline_s,
)
from pdserve.engine.messages import DecodeStats

WINDOW_S = 0.3


@pytest.fixture
def supervisor() -> Supervisor:
    config = RouterConfig(max_restarts=2, restart_window_s=WINDOW_S)
    return Supervisor(config, Router(config), scaler=None, launcher=None)


def test_restarts_stop_at_the_bound_per_role_and_come_back_with_the_window(supervisor):
    assert supervisor._may_restart(DECODE) and supervisor._may_restart(DECODE)
    assert not supervisor._may_restart(DECODE)
    assert supervisor._may_restart(PREFILL)  # another role's budget
    time.sleep(WINDOW_S + 0.05)
    assert supervisor._may_restart(DECODE)


def test_the_bounds_are_checked():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        RouterConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="migration_limit=-1"):
        RouterConfig(migration_limit=-1)
    with pytest.raises(ValueError, match="heartbeat_timeout_s=0"):
        RouterConfig(heartbeat_timeout_s=0)


def decode_worker(step_s: float = 0.0, step_expected_s: float = 0.0) -> WorkerHandle:
    w = WorkerHandle("decode-0", DECODE, actor=None, placement_group=None, num_gpus=0)
    w.stats = DecodeStats(
        "decode-0", 1, 0, 1, 8, 8, 16, 0, step_s=step_s, step_expected_s=step_expected_s
    )
    w.last_heartbeat = 100.0
    return w


def test_an_idle_worker_is_lost_once_silent_past_the_heartbeat_timeout():
    config = RouterConfig(heartbeat_timeout_s=3.0)
    w = decode_worker()
    assert stall_reason(w, 102.9, config) is None
    why = stall_reason(w, 103.1, config)
    assert "no answer for 3.1s" in why and "router.heartbeat_timeout_s=3" in why
    w.last_heartbeat = 0.0  # not started: never judged
    assert stall_reason(w, 1000.0, config) is None


def test_a_long_step_extends_the_silence_allowed_to_its_deadline():
    config = RouterConfig(heartbeat_timeout_s=3.0)
    # a prefill chunk expected to take 5 s, 1 s in: deadline 4 x 5 s, so silence is allowed up to 19 s + 3 s
    w = decode_worker(step_s=1.0, step_expected_s=5.0)
    assert step_deadline_s(w) == (1.0, STEP_DEADLINE_FACTOR * 5.0)
    assert stall_reason(w, 100.0 + 21.9, config) is None
    assert "its step had run 1.0s of a 20.0s deadline" in stall_reason(w, 100.0 + 22.1, config)
    # a step whose worker measured nothing yet gets UNKNOWN_STEP_S
    assert step_deadline_s(decode_worker(step_s=1.0)) == (1.0, UNKNOWN_STEP_S)


def test_a_worker_that_answers_but_reports_a_step_past_its_deadline_is_lost():
    config = RouterConfig(heartbeat_timeout_s=3.0)
    assert (
        stall_reason(decode_worker(step_s=0.2 + 2.9, step_expected_s=0.05), 100.0, config) is None
    )
    why = stall_reason(decode_worker(step_s=0.2 + 3.1, step_expected_s=0.05), 100.0, config)
    assert "its step has run 3.3s, past its deadline of 0.2s" in why


def test_the_watch_skips_a_round_the_router_woke_late_for_then_finds_the_silent_worker():
    config = RouterConfig(heartbeat_timeout_s=0.5)
    router = Router(config)
    supervisor = Supervisor(config, router, scaler=None, launcher=None)
    router.on_worker_lost = lambda *_: None  # nothing to replace it with here
    w = decode_worker()
    w.state = WorkerState.SERVING
    router.workers[w.worker_id] = w

    async def run():
        watch = asyncio.create_task(supervisor.watch())
        w.last_heartbeat = time.monotonic()
        await asyncio.sleep(0.05)
        time.sleep(1.0)  # the router's loop is held: answers that came meanwhile wait behind it
        await asyncio.sleep(0.05)
        held_round = w.state
        await asyncio.sleep(2 * WATCH_S + 0.1)  # no answer came after all
        watch.cancel()
        return held_round

    assert asyncio.run(run()) == WorkerState.SERVING
    assert w.state == WorkerState.DEAD and w.worker_id not in router.workers
