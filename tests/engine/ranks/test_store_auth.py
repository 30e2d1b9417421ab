"""The rank group's store is signed (`process.signed_store`): a client of the driver's TCPStore without the
group's secret, forging, overwriting and deleting every key it finds while the ranks meet, neither stalls nor
moves the group; a rank given another secret fails the join with a clear error within its timeout."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from pdserve.engine.ranks.channel import decode, encode
from pdserve.engine.ranks.group import LocalRankLauncher, RankGroup, RankGroupConfig
from pdserve.engine.ranks.process import HandlerSpec
from pdserve.kvtransfer.store import new_secret

from . import _rank_handlers

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

ECHO = HandlerSpec(f"{_rank_handlers.__name__}:echo", {"tag": "t"})
ATTACK_EVERY_S = 0.001


def _config(join_timeout_s: float) -> RankGroupConfig:
    return RankGroupConfig(
        2, join_timeout_s=join_timeout_s, step_timeout_s=20.0, stop_timeout_s=10.0
    )


class _Attacker(threading.Thread):
    """Connects to `group`'s store as soon as it is hosted and, every ATTACK_EVERY_S until stopped, forges,
    overwrites or deletes every key of the ranks' rendezvous it lists; counts what it did to which keys."""

    def __init__(self, group: RankGroup):
        super().__init__(daemon=True)
        self.group, self.stop, self.hit, self.error = group, threading.Event(), set(), None

    def run(self) -> None:
        try:
            while self.group._store is None and not self.stop.wait(0.001):
                pass
            if self.stop.is_set():
                return
            raw = dist.TCPStore(
                "127.0.0.1", self.group._store.port, is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )  # fmt: skip
            turn = 0
            while not self.stop.wait(ATTACK_EVERY_S):
                for key in raw.list_keys():
                    if not key.startswith("pdserve-ranks/"):
                        continue
                    turn += 1
                    if turn % 3 == 0:
                        raw.delete_key(key)
                    else:  # a value of the signed form, made without the secret, or plain garbage
                        raw.set(key, b"0" * 64 + b"forged" if turn % 3 == 1 else b"garbage")
                    self.hit.add(key)
        except Exception as e:  # reported by the test
            self.error = e


class _AfterTheAttackLauncher(LocalRankLauncher):
    """Launches the ranks once the attacker has tampered with a key of the driver's (bounded): the join is
    fast, and a thread of a loaded machine may otherwise not run before it is over."""

    def __init__(self):
        super().__init__()
        self.attacker: _Attacker | None = None

    def launch(self, bootstraps: list[bytes]) -> None:
        def later():
            give_up = time.monotonic() + 20.0
            while not self.attacker.hit and time.monotonic() < give_up:
                time.sleep(0.01)
            LocalRankLauncher.launch(self, bootstraps)

        threading.Thread(target=later, daemon=True).start()


def test_an_attacker_on_the_store_neither_stalls_nor_moves_the_join():
    launcher = _AfterTheAttackLauncher()
    group = RankGroup(_config(30.0), ECHO, launcher)
    attacker = launcher.attacker = _Attacker(group)
    attacker.start()
    try:
        with group:
            attacker.stop.set()
            replies = group.step({"step": 1})
            assert [r["rank"] for r in replies] == [0, 1]
    finally:
        attacker.stop.set()
        attacker.join(10)
    assert attacker.error is None, attacker.error
    assert attacker.hit, "the attacker found no rendezvous key to tamper with"


class _WrongSecretLauncher(LocalRankLauncher):
    """Launches ranks whose bootstrap carries a secret other than the driver's."""

    def launch(self, bootstraps: list[bytes]) -> None:
        forged = []
        for boot in bootstraps:
            fields = decode(boot)
            fields["secret"] = new_secret()
            forged.append(encode(fields))
        super().launch(forged)


def test_a_rank_with_another_secret_fails_the_join_clearly():
    join_timeout_s = 2.0
    group = RankGroup(_config(join_timeout_s), ECHO, _WrongSecretLauncher())
    start = time.monotonic()
    with pytest.raises(Exception, match="in the store") as e, group:
        pass
    elapsed = time.monotonic() - start
    assert elapsed < join_timeout_s + 15, f"the join failed after {elapsed:.1f}s"
    assert "pdserve-ranks/" in str(e.value)
    assert all(not p.is_alive() for p in group.launcher.procs)
