"""DistKVSender -> DistKVReceiver over gloo, both ends in this process (each with its own store client): pages land
at the reserved page ids and nowhere else, transfers cut into pieces reassemble, a cancelled or mismatched
transfer is discarded while the pair stays usable, an expected transfer that never comes fails at its deadline,
and P's metadata for each transfer comes back with its result.
Killed peers and stalled transfers between two OS processes are in tests/workers/test_two_process.py."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from pdserve.kvtransfer import MAX_METADATA_BYTES, ExpectedTransfer, KVTransferConfig
from pdserve.kvtransfer import _receiver as receiver_module
from pdserve.kvtransfer.dist import DistKVReceiver, DistKVSender, chunk_plan, connect_store
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.kvtransfer.store import new_secret
from pdserve.model.errors import TransferError

LAYERS, PAGES, PAGE_SIZE, DIM = 5, 40, 4, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("total", "largest", "first", "plan"),
    [
        (27, 5, 1, [(0, 1), (1, 5), (5, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 27)]),
        (27, 26, 1, [(0, 1), (1, 5), (5, 22), (22, 26), (26, 27)]),
        (61, 60, 1, [(0, 1), (1, 5), (5, 21), (21, 40), (40, 56), (56, 60), (60, 61)]),
        (512, 512, 16, [(0, 512)]),
        (512, 511, 16, [(0, 16), (16, 80), (80, 432), (432, 496), (496, 512)]),
        (512, 100, 16, [(0, 16), (16, 80), (80, 168), (168, 256), (256, 344), (344, 432), (432, 496),
                        (496, 512)]),
        (27, 27, 1, [(0, 27)]),
        (27, 100, 1, [(0, 27)]),
        (5, 2, 1, [(0, 1), (1, 3), (3, 4), (4, 5)]),
        (4, 1, 1, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (2, 1, 1, [(0, 2)]),
        (1, 1, 1, [(0, 1)]),
        (10, 4, 9, [(0, 4), (4, 7), (7, 10)]),
        (30, 100, 20, [(0, 30)]),
    ],
)  # fmt: skip
def test_chunk_plan_covers_every_page_once(total, largest, first, plan):
    assert chunk_plan(total, largest, first) == plan


@pytest.fixture
def make_link():
    """Builds (sender, receiver, source cache, destination cache) over gloo, pieces of 1 to 4 pages; closes
    them after the test."""
    built = []

    def make(
        idle_timeout_s: float = 900.0, in_place: bool = False, expect_grace_s: float = 5.0,
        connect_timeout_s: float = 10.0,
    ):  # fmt: skip
        page_bytes = LAYERS * PAGE_SIZE * DIM * 4
        config = KVTransferConfig(
            store_port=free_port(), timeout_s=10, connect_timeout_s=connect_timeout_s,
            idle_timeout_s=idle_timeout_s,
            chunk_bytes=4 * page_bytes, first_piece_bytes=page_bytes, pipeline_min_bytes=0,
            expect_grace_s=expect_grace_s,
        )  # fmt: skip
        secret = new_secret()
        d_store = connect_store(config, is_master=True, secret=secret)
        p_store = connect_store(config, is_master=False, secret=secret)
        source = torch.randn(PAGES, LAYERS, PAGE_SIZE, DIM)
        dest = torch.zeros(PAGES, LAYERS, PAGE_SIZE, DIM)
        sender = DistKVSender(config, p_store, "p0", torch.device("cpu"))
        receiver = DistKVReceiver(config, d_store, "d0", dest)
        # gloo cannot withdraw a posted operation, so only NCCL links move pages in place; these tests do it
        # over gloo where no transfer is cancelled or broken under way.
        sender.in_place = receiver.in_place = in_place
        built.append((sender, receiver))
        return sender, receiver, source, dest

    yield make
    for sender, receiver in built:
        sender.close()
        receiver.close()


@pytest.fixture
def link(make_link):
    return make_link()


def wait_results(receiver, count: int, timeout_s: float = 10.0):
    deadline, results = time.monotonic() + timeout_s, []
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {results} of {count} results"
        results += receiver.poll()
        time.sleep(0.005)
    return results


def expect(receiver, transfer_id: int, pages: list[int], deadline_s: float = 30.0) -> None:
    receiver.expect(ExpectedTransfer(transfer_id, "p0", pages, time.monotonic() + deadline_s))


def test_pages_land_scattered_in_pieces(link):
    sender, receiver, source, dest = link
    g = torch.Generator().manual_seed(0)
    for transfer_id, num_pages in [(1, 13), (2, 1), (3, 13)]:
        src_pages = torch.randperm(PAGES, generator=g)[:num_pages].tolist()
        dst_pages = torch.randperm(PAGES, generator=g)[:num_pages].tolist()
        before = dest.clone()
        expect(receiver, transfer_id, dst_pages)
        sender.send("d0", transfer_id, source, src_pages, num_tokens=7, first_token=42)
        [result] = wait_results(receiver, 1)
        assert (result.transfer_id, result.num_tokens, result.first_token) == (transfer_id, 7, 42)
        assert result.error is None
        assert torch.equal(dest[dst_pages], source[src_pages])
        others = [p for p in range(PAGES) if p not in dst_pages]
        assert torch.equal(dest[others], before[others])
    assert sender.last_profile["d0"].num_pieces == 5  # 13 pages: 1 + 4 + 4 + 3 + 1


@pytest.mark.parametrize("in_place", [False, True], ids=["packed", "in-place"])
def test_each_transfer_s_metadata_arrives_with_its_pages(make_link, in_place):
    """P's bytes for a request reach D in the transfer's result, each transfer its own (none, a few, more than
    the buffers held before), also behind a discarded transfer that carried some; D's clock brackets the
    transfer."""
    sender, receiver, source, dest = make_link(in_place=in_place)
    blobs = {1: b"first", 2: b"", 3: bytes(range(256)) * 20, 5: b"\x00after a discarded one"}
    expect(receiver, 4, [30])
    receiver.cancel(4)  # discarded: its metadata is received all the same
    sender.send("d0", 4, source, [0], PAGE_SIZE, 5, metadata=b"dropped" * 300)
    for transfer_id, blob in blobs.items():
        pages = [3 * transfer_id, 3 * transfer_id + 1]
        expect(receiver, transfer_id, pages)
        before = time.monotonic()
        sender.send("d0", transfer_id, source, [9, 4], 2 * PAGE_SIZE, 7, metadata=blob)
        [result] = wait_results(receiver, 1)
        assert (result.transfer_id, result.error, result.metadata) == (transfer_id, None, blob)
        assert before <= result.started_at <= result.completed_at <= time.monotonic()
        assert torch.equal(dest[pages], source[[9, 4]])
    assert not dest[30].any()


def test_metadata_over_the_bound_is_refused_before_anything_is_sent(link):
    sender, receiver, source, dest = link
    with pytest.raises(TransferError, match="bytes of metadata, more than"):
        sender.send("d0", 1, source, [0], PAGE_SIZE, 5, metadata=bytes(MAX_METADATA_BYTES + 1))
    hub = LoopbackHub()
    LoopbackReceiver(hub, "d0", torch.zeros_like(dest))
    with pytest.raises(TransferError, match="bytes of metadata, more than"):
        LoopbackSender(hub).send("d0", 1, source, [0], 4, 5, metadata=bytes(MAX_METADATA_BYTES + 1))
    expect(receiver, 2, [1])
    sender.send("d0", 2, source, [0], PAGE_SIZE, 5, metadata=bytes(MAX_METADATA_BYTES))  # the bound
    [result] = wait_results(receiver, 1)
    assert result.error is None and result.metadata == bytes(MAX_METADATA_BYTES)


@pytest.mark.parametrize(
    ("src_pages", "dst_pages", "pieces"),
    [
        (list(range(3, 16)), list(range(20, 33)), 1),  # runs on both sides: one piece, no copy
        (list(range(3, 16)), [30, 31, 32, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 1),  # D unpacks
        ([7, 8, 9, 10, 0, 11, 12, 13, 14, 1, 2, 3, 4], list(range(20, 33)), 5),  # P packs some pieces
        ([9, 2, 5, 1, 0, 3, 4, 6, 7, 8, 10, 11, 12], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 30, 31, 32], 5),
    ],
)  # fmt: skip
def test_runs_of_pages_move_in_place(make_link, src_pages, dst_pages, pieces):
    sender, receiver, source, dest = make_link(in_place=True)
    before = dest.clone()
    expect(receiver, 1, dst_pages)
    sender.send("d0", 1, source, src_pages, num_tokens=50, first_token=42)
    [result] = wait_results(receiver, 1)
    assert (result.transfer_id, result.num_tokens, result.error) == (1, 50, None)
    assert torch.equal(dest[dst_pages], source[src_pages])
    others = [p for p in range(PAGES) if p not in dst_pages]
    assert torch.equal(dest[others], before[others])
    assert sender.last_profile["d0"].num_pieces == pieces


def test_a_run_moves_into_a_few_runs_in_place_cut_where_the_receiver_advised(make_link):
    sender, receiver, source, dest = make_link(in_place=True)
    dst_pages = [30, 31, 32, 33, 0, 1, 2, 3, 4, 20, 21, 22, 23]  # three runs
    cuts = receiver.expect(ExpectedTransfer(1, "p0", dst_pages, time.monotonic() + 30))
    assert cuts == (4, 9)
    before = dest.clone()
    sender.send("d0", 1, source, list(range(3, 16)), 50, 42, dest_cuts=cuts)
    [result] = wait_results(receiver, 1)
    assert (result.transfer_id, result.num_tokens, result.first_token, result.error) == (
        1,
        50,
        42,
        None,
    )
    assert torch.equal(dest[dst_pages], source[3:16])
    others = [p for p in range(PAGES) if p not in dst_pages]
    assert torch.equal(dest[others], before[others])
    assert sender.last_profile["d0"].num_pieces == 3
    # Cancelled before its pages came: D still takes every piece (discarded), and the link stays usable.
    cuts = receiver.expect(ExpectedTransfer(2, "p0", dst_pages, time.monotonic() + 30))
    receiver.cancel(2)
    sender.send("d0", 2, source, list(range(20, 33)), 50, 42, dest_cuts=cuts)
    assert torch.equal(dest[dst_pages], source[3:16])
    # Where P's pages are not one run, it cuts as it likes and D unpacks what is not in place.
    cuts = receiver.expect(ExpectedTransfer(3, "p0", dst_pages, time.monotonic() + 30))
    src_pages = [9, 2, 5, 1, 0, 3, 4, 6, 7, 8, 10, 11, 12]
    sender.send("d0", 3, source, src_pages, 50, 42, dest_cuts=cuts)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[dst_pages], source[src_pages])
    assert receiver.poll() == []


def test_the_receiver_advises_cuts_only_for_a_few_runs(make_link):
    _, receiver, _, _ = make_link(in_place=True)
    deadline = time.monotonic() + 30
    assert (
        receiver.expect(ExpectedTransfer(1, "p0", list(range(20, 33)), deadline)) == ()
    )  # one run
    eight = [0, 2, 4, 6, 8, 10, 12, 14]  # eight runs: KVTransferConfig.max_receiver_runs
    assert receiver.expect(ExpectedTransfer(2, "p0", eight, deadline)) == (1, 2, 3, 4, 5, 6, 7)
    nine = [*eight, 16]
    assert receiver.expect(ExpectedTransfer(3, "p0", nine, deadline)) == ()
    _, over_gloo, _, _ = make_link()  # pages not moved in place: no advice
    assert over_gloo.expect(ExpectedTransfer(1, "p0", eight, deadline)) == ()
    _, receiver, _, _ = make_link(in_place=True)
    receiver.config = dataclasses.replace(
        receiver.config, pipeline_min_bytes=8 * 4 * LAYERS * PAGE_SIZE * DIM
    )
    assert (
        receiver.expect(ExpectedTransfer(1, "p0", eight, deadline)) == ()
    )  # small: unpacked instead


def test_cuts_out_of_order_fail_before_anything_is_sent(make_link):
    """(D's side of a wrong cut, a header cut at runs it did not advise, fails that transfer and tears the link
    down; over gloo, which cannot withdraw a posted send, that cannot run in one process, and no test covers it
    over NCCL.)"""
    sender, receiver, source, dest = make_link(in_place=True)
    with pytest.raises(TransferError, match="not increasing"):
        sender.send("d0", 9, source, list(range(3, 16)), 50, 42, dest_cuts=(5, 5))
    with pytest.raises(TransferError, match="not increasing"):
        sender.send("d0", 9, source, list(range(3, 16)), 50, 42, dest_cuts=(4, 13))
    expect(receiver, 2, list(range(20, 33)))
    sender.send("d0", 2, source, list(range(13)), 13 * PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[20:33], source[:13])


def test_cancelled_transfer_is_discarded_and_pair_stays_usable(link):
    sender, receiver, source, dest = link
    expect(receiver, 1, [0])
    sender.send("d0", 1, source, [0], PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    # Linked and idle: nothing expected, yet a cancelled transfer's sender is answered (discarded).
    expect(receiver, 2, list(range(13)))
    receiver.cancel(2)
    time.sleep(0.1)
    sender.send("d0", 2, source, list(range(13)), 13 * PAGE_SIZE, 5)
    assert not dest[1:].any()
    expect(receiver, 3, list(range(20, 33)))
    sender.send("d0", 3, source, list(range(13)), 13 * PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[20:33], source[:13])
    assert receiver.poll() == []


def test_a_header_before_its_expectation_waits_for_it(link):
    """A rank of a decode worker of several ranks learns of a transfer with its worker's next step, which may
    come after the prefill worker sent: the header waits for the expectation, behind another expected one."""
    sender, receiver, source, dest = link
    expect(receiver, 1, [0])  # the link is up and a header receive posted for transfer 1's sake
    early = threading.Thread(target=sender.send, args=("d0", 2, source, [3, 4], 2 * PAGE_SIZE, 9))
    early.start()
    time.sleep(0.3)
    assert early.is_alive() and receiver.poll() == [] and not dest[10:12].any()
    expect(receiver, 2, [10, 11])
    early.join(timeout=10)
    assert not early.is_alive()
    [result] = wait_results(receiver, 1)
    assert (result.transfer_id, result.num_tokens, result.first_token, result.error) == (
        2,
        8,
        9,
        None,
    )
    assert torch.equal(dest[10:12], source[3:5])
    sender.send("d0", 1, source, [5], PAGE_SIZE, 4)
    assert [(r.transfer_id, r.error) for r in wait_results(receiver, 1)] == [(1, None)]
    assert torch.equal(dest[0], source[5])


def test_a_header_never_expected_is_discarded_after_the_grace(make_link):
    sender, receiver, source, dest = make_link(expect_grace_s=0.2)
    expect(receiver, 1, [0])
    started = time.monotonic()
    sender.send("d0", 7, source, [3], PAGE_SIZE, 9)  # answered (discarded), not left to time out
    assert 0.2 <= time.monotonic() - started < 5
    assert receiver.poll() == [] and not dest.any()
    sender.send("d0", 1, source, [5], PAGE_SIZE, 4)  # the pair stays usable
    assert [(r.transfer_id, r.error) for r in wait_results(receiver, 1)] == [(1, None)]
    assert torch.equal(dest[0], source[5])


def test_page_count_mismatch_fails_only_that_transfer(link):
    sender, receiver, source, dest = link
    expect(receiver, 1, [3, 4])
    sender.send("d0", 1, source, [0, 1, 2], 3 * PAGE_SIZE, 5)
    [result] = wait_results(receiver, 1)
    assert result.transfer_id == 1 and "3 pages for 2 reserved" in result.error
    assert not dest.any()
    expect(receiver, 2, [3, 4])
    sender.send("d0", 2, source, [0, 1], 2 * PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]


def test_transfer_never_sent_fails_at_its_deadline(link):
    sender, receiver, _, _ = link
    sender.connect("d0")
    expect(receiver, 1, [0], deadline_s=0.3)
    [result] = wait_results(receiver, 1, timeout_s=5)
    assert result.transfer_id == 1 and "before the deadline" in result.error


def test_loopback_writes_the_reserved_pages():
    hub = LoopbackHub()
    source = torch.randn(PAGES, LAYERS, PAGE_SIZE, DIM)
    dest = torch.zeros(PAGES, LAYERS, PAGE_SIZE, DIM)
    receiver = LoopbackReceiver(hub, "d0", dest)
    expect(receiver, 1, [7, 2])
    LoopbackSender(hub).send("d0", 1, source, [0, 5], 8, 3, metadata=b"meta")
    [result] = receiver.poll()
    assert (result.error, result.first_token, result.metadata) == (None, 3, b"meta")
    assert result.started_at <= result.completed_at
    assert torch.equal(dest[[7, 2]], source[[0, 5]])


def test_cancel_mid_transfer_returns_at_once_and_nothing_is_written(link):
    sender, receiver, source, dest = link
    expect(receiver, 1, [0])
    sender.send("d0", 1, source, [0], PAGE_SIZE, 5)
    wait_results(receiver, 1)
    expect(receiver, 2, list(range(20, 33)))
    sender.delay_after_header_s = 2.0  # the header is in, the pages come later
    errors = []

    def send() -> None:
        try:
            sender.send("d0", 2, source, list(range(13)), 13 * PAGE_SIZE, 5)
        except TransferError as e:
            errors.append(e)

    sending = threading.Thread(target=send)
    sending.start()
    time.sleep(0.5)
    start = time.monotonic()
    receiver.cancel(2)
    assert time.monotonic() - start < 1.0, "cancel must not wait for the link"
    sending.join(10)
    assert not sending.is_alive() and errors == []  # acknowledged as discarded
    assert not dest[20:33].any()
    assert receiver.poll() == []


def test_header_receive_is_posted_only_while_a_transfer_may_come(link, monkeypatch):
    """A posted NCCL receive holds the decode GPU until its message comes: none stays posted once nothing is
    expected (no retirement follows a completed transfer); a cancelled transfer that is never sent has its
    receive withdrawn by retiring the link, which is rebuilt on the next transfer."""
    monkeypatch.setattr(receiver_module, "_RETIRE_UNEXPECTED_S", 0.3)
    sender, receiver, source, dest = link
    expect(receiver, 1, [0])
    sender.send("d0", 1, source, [0], PAGE_SIZE, 5)
    wait_results(receiver, 1)
    [pair] = [peer.pair for peer in receiver._peers.values()]
    epoch = pair.epoch
    time.sleep(
        0.8
    )  # idle, past the retirement delay twice over: nothing was posted, nothing retired
    assert pair.current_epoch() == epoch
    expect(receiver, 2, [1])
    time.sleep(0.1)  # its header receive is posted
    receiver.cancel(2)
    time.sleep(1.2)  # kept for a late send 0.3 s, then retired 0.3 s later (checks every 0.05 s)
    assert pair.current_epoch() > epoch
    expect(receiver, 3, [1, 2])
    sender.send("d0", 3, source, [3, 4], 2 * PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[[1, 2]], source[[3, 4]])


def test_idle_link_is_retired_before_its_timeout_then_rebuilt(make_link):
    """A header receive left posted for half the group's timeout (NCCL's watchdog would end the process at the
    full timeout) retires the link; the next transfer rebuilds it."""
    sender, receiver, source, dest = make_link(idle_timeout_s=1.0)
    expect(receiver, 1, [0])
    sender.send("d0", 1, source, [0], PAGE_SIZE, 5)
    wait_results(receiver, 1)
    [pair] = [peer.pair for peer in receiver._peers.values()]
    epoch = pair.epoch
    expect(receiver, 2, [1], deadline_s=60)  # expected, never sent
    time.sleep(1.0)
    assert pair.current_epoch() > epoch
    receiver.cancel(2)
    expect(receiver, 3, [1, 2])
    sender.send("d0", 3, source, [3, 4], 2 * PAGE_SIZE, 5)
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[[1, 2]], source[[3, 4]])


@pytest.mark.gpu
def test_pair_makes_its_stream_current_and_restores_the_threads_own():
    """Pair.on_device switches device and stream through torch's lower-level calls: on leaving, the thread has
    its device back, and that device its stream (on two GPUs the pair lives on the other one)."""
    from pdserve.kvtransfer._link import Pair

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    pair = Pair(None, "p0", "d0", 0, "nccl", KVTransferConfig(), device)
    own = torch.cuda.Stream(device)
    start_device = torch.cuda.current_device()
    with torch.cuda.device(device), torch.cuda.stream(own):
        torch.cuda.set_device(start_device)
        with pair.on_device():
            assert torch.cuda.current_device() == device.index
            assert torch.cuda.current_stream(device) == pair.stream
            with pair.on_device():  # re-entered, as the receiving thread does around its transfers
                assert torch.cuda.current_stream(device) == pair.stream
            assert torch.cuda.current_stream(device) == pair.stream
        assert torch.cuda.current_device() == start_device
        assert torch.cuda.current_stream(device) == own


def test_a_forgotten_peer_fails_its_waiting_and_later_sends_at_once(make_link):
    sender, _, source, _ = make_link()  # connect_timeout_s 10: nobody joins as "d-lost"
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            sender.send("d-lost", 1, source, [0, 1], 2 * PAGE_SIZE, 7)
        except TransferError as e:
            outcome.append(e)

    waiting = threading.Thread(target=send)
    waiting.start()
    time.sleep(0.3)  # the send waits for the peer to join its link
    start = time.monotonic()
    sender.forget("d-lost")
    waiting.join(timeout=5)
    assert not waiting.is_alive() and time.monotonic() - start < 2
    (error,) = outcome
    assert "d-lost was lost" in str(error)
    with pytest.raises(TransferError, match="d-lost.r1 was lost"):
        sender.forget("d-lost")  # its ranks' endpoints too (a decode worker of several ranks)
        sender.send("d-lost.r1", 2, source, [0], PAGE_SIZE, 7)


def test_a_peer_that_died_while_joining_holds_up_only_its_own_link(make_link):
    """A decode peer that joined the link (its ready key is in the store) and died before building its group
    leaves our side's group waiting in the store for its address. That wait lasts the build's bound (the
    connect timeout, not the group's 900 s idle timeout) and holds no other pair: a transfer to a live peer
    meanwhile goes through at once, and a send queued behind the stuck one fails as soon as the peer is
    forgotten."""
    sender, receiver, source, dest = make_link(connect_timeout_s=3.0)
    sender.store.set("pdkv/p0/d-dead/0/ready1", "1")  # joined, then died
    errors: dict[int, tuple[float, BaseException]] = {}

    def send_to_dead(transfer_id: int) -> None:
        start = time.monotonic()
        try:
            sender.send("d-dead", transfer_id, source, [0], PAGE_SIZE, 7)
        except TransferError as e:
            errors[transfer_id] = (time.monotonic() - start, e)

    stuck = threading.Thread(target=send_to_dead, args=(1,))
    stuck.start()
    time.sleep(0.3)  # building the group with "d-dead"
    queued = threading.Thread(target=send_to_dead, args=(2,))
    queued.start()
    live = threading.Thread(target=sender.send, args=("d0", 3, source, [3, 4], 2 * PAGE_SIZE, 5))
    expect(receiver, 3, [1, 2])
    start = time.monotonic()
    live.start()
    live.join(timeout=2.0)
    assert not live.is_alive(), "a transfer to a live peer waited behind the dead peer's link"
    assert [r.error for r in wait_results(receiver, 1)] == [None]
    assert torch.equal(dest[[1, 2]], source[[3, 4]])
    assert time.monotonic() - start < 2.0
    sender.forget("d-dead")
    queued.join(timeout=1.0)
    assert not queued.is_alive() and "d-dead was lost" in str(errors[2][1])
    stuck.join(timeout=10.0)
    assert not stuck.is_alive()
    took, error = errors[1]
    assert took < 3.0 + 2.0, f"the build waited {took:.1f}s for the dead peer: {error}"
