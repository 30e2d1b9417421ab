"""The rendezvous store against a client that has its address but not the deployment's secret (`kvtransfer.store`):
it can list, read, overwrite and delete every key, and none of that fails or stalls a transfer.

Real gloo groups and a real TCPStore, both ends in this process; the attacker is a thread with its own store
client. While it works, the test breaks the link every few transfers (as a failed send would), so that pairs
rebuild their group under attack: each transfer, rebuild included, must complete within a second, and the
tampering may cost the pair at most one epoch (one retry) beyond the one each break costs."""

from __future__ import annotations

import random
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdserve.kvtransfer import ExpectedTransfer, KVTransferConfig
from pdserve.kvtransfer._link import Pair
from pdserve.kvtransfer.dist import DistKVReceiver, DistKVSender, connect_store
from pdserve.kvtransfer.store import SignedStore, new_secret

from .test_dist import DIM, LAYERS, PAGE_SIZE, PAGES, free_port, wait_results

ATTACK_PERIOD_S = 0.005
TRANSFERS = 12
BREAK_EVERY = 3
MAX_TRANSFER_S = 1.0


class Attacker:
    """A client of the store without the secret. Every `period_s` it lists the keys and does `mode` to the
    pair's: `bump` (the epoch key, there or not: raised with add when it holds a number, else set to a larger
    number, now and then to garbage raised with add), `delete`, `forge` (each value replaced by
    bytes of a signed value's shape), `replay` (each value replaced by one seen earlier under another key, the
    same flag or group key of another epoch, the next epoch's keys written ahead from the current ones, the
    epoch key set back to an older epoch's value)."""

    def __init__(self, port: int, mode: str, period_s: float = ATTACK_PERIOD_S):
        self.port, self.mode, self.period_s = port, mode, period_s
        self.stop = threading.Event()
        self.acts = 0
        self.seen: dict[str, set[bytes]] = {}
        self._rng = random.Random(0)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"attacker-{mode}")

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def _client(self) -> dist.TCPStore | None:
        while not self.stop.is_set():
            try:
                return dist.TCPStore(
                    "127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=2),
                    wait_for_workers=False,
                )  # fmt: skip
            except dist.DistError:  # a connect can stall for seconds: try again
                continue
        return None

    def _run(self) -> None:
        client, rounds = self._client(), 0
        while client is not None and not self.stop.wait(self.period_s):
            rounds += 1
            try:
                self._act(client, rounds)
            except dist.DistError:
                # The server drops a client whose add hit a non-number: reconnect.
                client = self._client()

    def _read(self, client, key: str) -> bytes | None:
        value = client.compare_set(key, "\x01", "\x01")
        return None if value == b"\x01" else value

    def _act(self, client, rounds: int) -> None:
        keys = [k for k in client.list_keys() if k.startswith("pdkv/")]
        if self.mode == "bump":  # every pair's epoch, whether or not the key is there yet
            keys = sorted({"/".join(k.split("/")[:3]) + "/epoch" for k in keys})
        for key in keys:
            value = self._read(client, key)
            if value is not None:
                self.seen.setdefault(key, set()).add(value)
        for key in keys:
            self.acts += 1
            if self.mode == "delete":
                client.delete_key(key)
            elif self.mode == "forge":
                fake = bytes(self._rng.choice(b"0123456789abcdef") for _ in range(64)) + b"1"
                client.set(key, fake)
            elif self.mode == "bump":
                value = self._read(client, key)
                if value is not None and value.isdigit():
                    client.add(key, 1)
                elif rounds % 10:
                    client.set(key, str(self._rng.randrange(10**6)))
                else:  # now and then: garbage, raised with add (the server drops this client)
                    client.set(key, b"\xff garbage")
                    client.add(key, 1)
            elif self.mode == "replay":
                self._replay(client, key)

    def _replay(self, client, key: str) -> None:
        tail = re.sub(r"^pdkv/[^/]+/[^/]+/(\d+/)?", "", key)
        others = [v for k, vs in self.seen.items() if k != key and k.endswith(tail) for v in vs]
        if key.endswith("/epoch"):
            others = sorted(self.seen.get(key, ()), key=lambda v: v[64:])[
                :1
            ]  # the oldest epoch seen
        if others:
            client.set(key, self._rng.choice(others))
        match = re.match(r"^(pdkv/[^/]+/[^/]+)/(\d+)/(.*)$", key)
        if match:  # the next epoch's key, written ahead with this epoch's value
            value = self._read(client, key)
            if value is not None:
                client.set(f"{match[1]}/{int(match[2]) + 1}/{match[3]}", value)


@pytest.fixture
def secret_link():
    """(sender, receiver, source, dest, port, secret) over gloo through a signed store; closed after the test."""
    built = []

    def make():
        port, secret = free_port(), new_secret()
        config = KVTransferConfig(
            store_port=port, timeout_s=10, connect_timeout_s=10, pipeline_min_bytes=0,
            chunk_bytes=4 * LAYERS * PAGE_SIZE * DIM * 4, first_piece_bytes=LAYERS * PAGE_SIZE * DIM * 4,
        )  # fmt: skip
        d_store = connect_store(config, is_master=True, secret=secret)
        p_store = connect_store(config, is_master=False, secret=secret)
        source = torch.randn(PAGES, LAYERS, PAGE_SIZE, DIM)
        dest = torch.zeros(PAGES, LAYERS, PAGE_SIZE, DIM)
        sender = DistKVSender(config, p_store, "p0", torch.device("cpu"))
        receiver = DistKVReceiver(config, d_store, "d0", dest)
        built.append((sender, receiver, d_store))
        return sender, receiver, source, dest, port, secret

    yield make
    for sender, receiver, _ in built:
        sender.close()
        receiver.close()


def _transfer(sender, receiver, source, dest, transfer_id: int, g: torch.Generator) -> float:
    """One transfer of 5 scattered pages; returns how long it took, send to result, after checking the pages."""
    src = torch.randperm(PAGES, generator=g)[:5].tolist()
    dst = torch.randperm(PAGES, generator=g)[:5].tolist()
    start = time.monotonic()
    receiver.expect(ExpectedTransfer(transfer_id, "p0", dst, start + 30))
    sender.send("d0", transfer_id, source, src, num_tokens=3, first_token=1)
    [result] = wait_results(receiver, 1, timeout_s=30)
    took = time.monotonic() - start
    assert result.error is None, result.error
    assert torch.equal(dest[dst], source[src])
    return took


@pytest.mark.parametrize("mode", ["bump", "delete", "forge", "replay"])
def test_transfers_complete_within_a_second_while_the_store_is_tampered_with(secret_link, mode):
    sender, receiver, source, dest, port, _ = secret_link()
    g = torch.Generator().manual_seed(1)
    _transfer(sender, receiver, source, dest, 0, g)  # the link is up before the attack
    pair = sender._pairs["d0"]
    first_epoch, breaks, times = pair.epoch, 0, []
    with Attacker(port, mode) as attacker:
        for transfer_id in range(1, TRANSFERS + 1):
            if transfer_id % BREAK_EVERY == 0:
                # As a failed send would: a new epoch, and the group rebuilt under attack.
                with pair.held():
                    pair.fail()
                breaks += 1
            times.append(_transfer(sender, receiver, source, dest, transfer_id, g))
    assert attacker.acts > 0
    assert max(times) < MAX_TRANSFER_S, times
    # Each break costs one epoch, and the tampering at most one more (one retry: D may find the link closed
    # before it could read the new epoch, deleted or overwritten meanwhile, and move the pair itself).
    assert breaks <= pair.epoch - first_epoch <= 2 * breaks, (pair.epoch, first_epoch, breaks)


def test_the_store_never_holds_the_secret_and_forged_or_copied_values_read_as_absent(secret_link):
    sender, receiver, source, dest, port, secret = secret_link()
    _transfer(sender, receiver, source, dest, 1, torch.Generator().manual_seed(2))
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    keys = raw.list_keys()
    assert any(k.endswith("/ready0") for k in keys) and any("/g/" in k for k in keys), keys
    for key in keys:
        assert secret not in key and secret.encode() not in raw.get(key), key
    signed = SignedStore(raw, secret)
    signed.set("pdkv/a/b/1/ready0", "1")
    assert signed.read("pdkv/a/b/1/ready0") == b"1"
    # Another pair's or another epoch's value, copied over: bound to its own key name.
    raw.set("pdkv/a/b/2/ready0", raw.get("pdkv/a/b/1/ready0"))
    raw.set("pdkv/a/c/1/ready0", raw.get("pdkv/a/b/1/ready0"))
    assert signed.read("pdkv/a/b/2/ready0") is None and signed.read("pdkv/a/c/1/ready0") is None
    raw.set("pdkv/a/b/1/ready0", "0" * 64 + "1")  # forged
    assert signed.read("pdkv/a/b/1/ready0") is None and not signed.check(["pdkv/a/b/1/ready0"])
    assert (
        SignedStore(raw, new_secret()).read("pdkv/a/b/2/ready0") is None
    )  # another deployment's key
    with pytest.raises(dist.DistStoreError, match="no valid value"):
        SignedStore(raw, secret, timeout_s=0.05).get("pdkv/a/b/1/ready0")


def test_a_forged_replayed_or_deleted_epoch_moves_no_pair(secret_link):
    sender, receiver, source, dest, port, secret = secret_link()
    _transfer(sender, receiver, source, dest, 1, torch.Generator().manual_seed(3))
    pair = sender._pairs["d0"]
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    key = "pdkv/p0/d0/epoch"
    with pair.held():
        pair.fail()
    old = raw.get(key)  # the first break's epoch, signed
    with pair.held():
        pair.fail()
    epoch = pair.current_epoch()
    for tamper in (
        lambda: raw.set(key, str(epoch + 5)),
        lambda: raw.set(key, old),  # replayed: an earlier epoch's signed value
        lambda: raw.delete_key(key),
        lambda: raw.set(key, "0" * 64 + str(epoch + 5)),
    ):
        tamper()
        assert pair.current_epoch() == epoch
    # D never read the new epoch (the store holds a forged one): it finds the link closed and moves the pair on
    # itself, or P, meeting it, puts the epoch back. Either way: at most one more epoch, and no wait.
    took = _transfer(sender, receiver, source, dest, 2, torch.Generator().manual_seed(4))
    assert took < MAX_TRANSFER_S and pair.epoch in (epoch, epoch + 1)


def test_an_unsigned_store_is_refused():
    config = KVTransferConfig(store_port=free_port())
    with pytest.raises(ValueError, match="no secret"):
        connect_store(config, is_master=True, secret="")
    store = dist.HashStore()
    with pytest.raises(TypeError, match="SignedStore"):
        Pair(store, "p0", "d0", 0, "gloo", config, torch.device("cpu"))


def test_signed_counters_compare_set_and_heal_over_a_real_store():
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=2), wait_for_workers=False
    )
    secret = new_secret()
    store = SignedStore(server, secret, prefix="t/", keep=True)
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    server.set("t/n", "41")  # an unsigned number counts as nothing
    assert store.add("n", 1) == 1
    assert store.compare_set("c", "", "a") == b"a" and store.compare_set("c", "x", "b") == b"a"
    assert store.compare_set("c", "a", "b") == b"b" and store.get("c") == b"b"
    # `heal` puts back what `set` wrote (not counters, nor compare_set's values), deleted or overwritten.
    store.set("a", "1")
    store.set("b", "2")
    server.delete_key("t/a")
    server.set("t/b", "0" * 64 + "2")
    assert store.heal() == 2 and store.get("a") == b"1" and store.get("b") == b"2"
    assert store.heal() == 0
    clone = store.clone()
    assert clone.get("c") == b"b" and clone.raw is not server
