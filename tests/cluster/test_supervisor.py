"""The supervisor's restart budget, without Ray: at most router.max_restarts replacements per role within
router.restart_window_s, counted per role, and the budget comes back as the window slides."""

from __future__ import annotations

import time

import pytest

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, PREFILL
from pdserve.cluster.router import Router
from pdserve.cluster.supervisor import Supervisor

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
