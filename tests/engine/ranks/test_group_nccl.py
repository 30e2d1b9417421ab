"""A rank group on GPUs: 2 local rank processes, one GPU each, joined by an NCCL group; each step the driver's
plan reaches the ranks over the shared-memory channel and their handlers all-reduce on their own GPU."""

from __future__ import annotations

import pytest

from pdserve.engine.ranks.group import RankGroup, RankGroupConfig
from pdserve.engine.ranks.process import HandlerSpec

from . import _rank_handlers

# its tests start processes of their own
pytestmark = pytest.mark.subprocess


@pytest.mark.multi_gpu
@pytest.mark.parametrize("channel", ["shm", "dist"])
def test_nccl_group_all_reduces_per_step(channel):
    config = RankGroupConfig(2, backend="nccl", channel=channel, join_timeout_s=120.0)
    with RankGroup(config, HandlerSpec(f"{_rank_handlers.__name__}:all_reduce")) as group:
        for scale in (1.0, 2.5):
            replies = group.step({"scale": scale})
            assert [r["device"] for r in replies] == ["cuda:0", "cuda:1"]
            assert all(r["sum"] == [3.0 * scale] * 4 for r in replies)
