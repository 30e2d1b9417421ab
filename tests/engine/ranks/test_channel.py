"""The plan channel, both implementations, under a real rank group of 1, 2 and 4 processes joined over gloo:
round trips in rank order, messages up to a few MiB each way, a message over the limit refused before it is sent,
and a rank that exits, raises or stalls surfacing at the driver as a clear error within the timeout, after which
every rank process is gone and the shared-memory file removed."""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.ranks.channel import (
    PlanChannelError,
    PlanTooLargeError,
    RankLostError,
    decode,
    encode,
)
from pdserve.engine.ranks.group import RankGroup, RankGroupConfig, RankStepError
from pdserve.engine.ranks.process import HandlerSpec
from pdserve.engine.ranks.shm_channel import ShmPlanChannel, ShmSpec

from . import _rank_handlers

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

# named as this test package imports it: spawned ranks inherit sys.path and import it the same way
ECHO = HandlerSpec(f"{_rank_handlers.__name__}:echo", {"tag": "t"})
MAX_BYTES = 4 << 20
STEP_TIMEOUT_S = 20.0


def group(world: int, channel: str, step_timeout_s: float = STEP_TIMEOUT_S) -> RankGroup:
    config = RankGroupConfig(
        world, channel=channel, join_timeout_s=120.0, step_timeout_s=step_timeout_s,
        stop_timeout_s=10.0, max_message_bytes=MAX_BYTES,
    )  # fmt: skip
    return RankGroup(config, ECHO)


def assert_all_gone(g: RankGroup, shm_path: str | None) -> None:
    assert all(not p.is_alive() for p in g.launcher.procs)
    if shm_path is not None:
        assert not Path(shm_path).exists()


@pytest.mark.parametrize("channel", ["shm", "dist"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_round_trips(world, channel):
    with group(world, channel) as g:
        shm_path = g.channel.spec.path if channel == "shm" else None
        pids = set()
        for step in range(20):
            blob = os.urandom(step * 37)
            replies = g.step({"step": step, "blob": blob})
            assert [r["rank"] for r in replies] == list(range(world))
            assert all(r["step"] == step and r["tag"] == "t" for r in replies)
            assert all(r["sha"] == hashlib.sha256(blob).hexdigest() for r in replies)
            pids |= {r["pid"] for r in replies}
        assert len(pids) == world and os.getpid() in pids

        # an idle driver: the ranks back off to sleeping, and wake for the next step
        time.sleep(1.5)
        assert [r["step"] for r in g.step({"step": 50})] == [50] * world

        # a plan and replies of 3 MiB each way
        blob = os.urandom(3 << 20)
        replies = g.step({"step": 99, "blob": blob, "reply_bytes": 3 << 20})
        assert all(r["sha"] == hashlib.sha256(blob).hexdigest() for r in replies)
        assert [r["blob"][:1] for r in replies[1:]] == [bytes([rank]) for rank in range(1, world)]
        assert all(len(r["blob"]) == 3 << 20 for r in replies[1:])

        # over the limit, or not plain values: refused at the driver, and the group goes on
        with pytest.raises(PlanTooLargeError, match="exceeds"):
            g.step({"step": 100, "blob": bytes(MAX_BYTES)})
        with pytest.raises(TypeError):
            g.step({"step": 100, "blob": object()})
        assert [r["step"] for r in g.step({"step": 101})] == [101] * world
    assert_all_gone(g, shm_path)


@pytest.mark.parametrize("channel", ["shm", "dist"])
def test_dead_rank_fails_the_step_within_the_timeout(channel):
    with group(4, channel) as g:
        shm_path = g.channel.spec.path if channel == "shm" else None
        g.step({"step": 0})
        start = time.monotonic()
        with pytest.raises(RankLostError) as info:
            g.step({"step": 1, "exit_on": 2})
        assert time.monotonic() - start < STEP_TIMEOUT_S + 5
        assert 2 in info.value.ranks
        with pytest.raises(PlanChannelError, match="not running"):
            g.step({"step": 2})
    assert_all_gone(g, shm_path)


@pytest.mark.parametrize("channel", ["shm", "dist"])
def test_stalled_rank_fails_the_step_at_the_timeout(channel):
    with group(2, channel, step_timeout_s=3.0) as g:
        start = time.monotonic()
        with pytest.raises(RankLostError, match="lost"):
            g.step({"step": 0, "stall_on": 1, "stall_s": 30.0})
        assert 3.0 <= time.monotonic() - start < 3.0 + 5
    assert_all_gone(g, None)


def _gone(pid: int) -> bool:
    """Exited (a zombie left for a parent that does not reap counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.parametrize("channel", ["shm", "dist"])
def test_ranks_exit_when_their_driver_is_killed(channel):
    here = Path(__file__).parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), env.get("PYTHONPATH")) if p)
    driver = subprocess.Popen(
        [sys.executable, str(here / "_orphan_driver.py"), channel], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 120)
        assert ready, "the driver printed no rank pids within 120 s"
        pids = json.loads(driver.stdout.readline())
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        if (
            channel == "shm"
        ):  # its name removed once the ranks mapped it: a killed driver leaves nothing
            for pid in pids:
                maps = [
                    m
                    for m in Path(f"/proc/{pid}/maps").read_text().splitlines()
                    if "pdserve-plan-" in m
                ]
                assert maps and all(m.endswith("(deleted)") for m in maps), maps
    finally:
        driver.kill()
        driver.wait()
    # a rank notices within a poll or a failed receive; its exit (torch's teardown) runs at the niceness the
    # test suite gives CPU-bound tests, behind the other workers' load
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if not _gone(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their killed driver by 30 s"


def test_handler_error_names_the_rank_and_its_traceback():
    failed = pytest.raises(RankStepError, match=r"(?s)rank 1:.*asked to fail on rank 1")
    with group(2, "shm") as g, failed:
        g.step({"step": 0, "raise_on": 1})
    assert_all_gone(g, None)


def test_shm_slots_in_process(tmp_path):
    """The slot protocol alone: sequence numbers, a reply to an older step not taken as the current one, the
    timeout naming the silent rank, the size limit, a file that is not a channel."""
    driver = ShmPlanChannel.create(3, plan_capacity=64, reply_capacity=16, directory=tmp_path)
    ranks = [ShmPlanChannel.open(driver.spec, r) for r in (1, 2)]
    try:
        assert ranks[0].receive(0.0) is None
        driver.broadcast(encode({"a": [1, 2]}))
        assert [decode(r.receive(1.0)) for r in ranks] == [{"a": [1, 2]}] * 2
        ranks[0].reply(b"one")
        with pytest.raises(RankLostError) as info:
            driver.gather(0.05)
        assert info.value.ranks == [2]
        ranks[1].reply(b"two")
        assert driver.gather(1.0) == [b"one", b"two"]

        driver.broadcast(b"next")
        assert ranks[1].receive(1.0) == b"next"
        ranks[1].reply(b"fresh")
        # rank 1's slot still holds its reply to the previous step
        with pytest.raises(RankLostError) as info:
            driver.gather(0.05)
        assert info.value.ranks == [1]

        with pytest.raises(PlanTooLargeError, match="65 bytes exceeds .* 64 bytes"):
            driver.broadcast(bytes(65))
        with pytest.raises(PlanTooLargeError, match="rank 2's reply"):
            ranks[1].reply(bytes(17))
        with pytest.raises(PlanChannelError, match="not this worker's plan channel"):
            ShmPlanChannel.open(ShmSpec(driver.spec.path, 3, 64, 32), 1)
    finally:
        for r in ranks:
            r.close()
        driver.close()
    assert not Path(driver.spec.path).exists()
    with pytest.raises(PlanChannelError, match="closed"):
        driver.broadcast(b"x")


def test_shm_half_written_header_is_not_a_message(tmp_path):
    """A reader that sees a message's sequence number before its length and CRC (zeroed, or a previous
    message's) waits: an empty message's CRC is 0, so the CRC covers the sequence number too."""
    driver = ShmPlanChannel.create(2, plan_capacity=64, reply_capacity=16, directory=tmp_path)
    rank = ShmPlanChannel.open(driver.spec, 1)
    try:
        buf, offset = driver._plan.buf, driver._plan.offset
        buf[offset : offset + 8] = (1).to_bytes(8, "little")  # length and CRC still zero
        assert rank.receive(0.01) is None
        driver.broadcast(b"first")
        assert rank.receive(1.0) == b"first"
        rank.reply(b"")
        assert driver.gather(1.0) == [b""]
        buf[offset : offset + 8] = (2).to_bytes(8, "little")  # length and CRC of message 1
        assert rank.receive(0.01) is None
        driver.broadcast(b"")
        assert rank.receive(1.0) == b""
    finally:
        rank.close()
        driver.close()


def test_dist_frames_at_the_boundary():
    """The gloo channel's fixed-size frames: a message that fills the frame exactly travels whole in it, one
    byte more leaves exactly that byte for the overflow collective."""
    from pdserve.engine.ranks.dist_channel import _frame, _unframe

    for n in (0, 1, 56, 57, 200):
        message = os.urandom(n)
        head, rest = _frame(message, 64)
        length, first = _unframe(head)
        assert len(head) == 64 and length == n
        assert first == message[:56]
        assert (rest is None) == (n <= 56)
        if rest is not None:
            assert first + rest.numpy().tobytes() == message
