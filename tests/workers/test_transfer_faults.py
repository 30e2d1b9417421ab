"""Transfer faults between a prefill and a decode worker in two OS processes (issue 46 item 5).

Each scenario runs on two backends: gloo on CPU (marked `subprocess`, the tiny model) and NCCL on cuda:0 /
cuda:1 (marked `multi_gpu`, skipped with fewer than two CUDA GPUs). Each asserts that every request finishes or
aborts with an error naming the peer within a bound, that no page is held on either side after, and that the
pair then serves new requests equal to the reference; it prints the time to recover.
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.decode import DecodeConfig
from pdserve.kvtransfer import KVTransferConfig

from .harness import MiniRouter
from .procs import WorkerProcess
from .test_two_process import PREFILL, assert_outputs_match, free_port, submit_all, workload

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.subprocess),
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.multi_gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
        ],
    ),
]


@pytest.fixture
def workers(backend, model_dir):
    """start(role, worker_id, kv, store_master=False, **decode_config) starts a worker on the backend's device
    for its role (NCCL: decode on cuda:1, prefill on cuda:0; float32 so outputs compare with the CPU
    reference); every worker started is stopped after the test."""
    started: list[WorkerProcess] = []

    def start(role, worker_id, kv, store_master=False, **decode_config) -> WorkerProcess:
        gpu = {"decode": "cuda:1", "prefill": "cuda:0"}[role] if backend == "nccl" else "cpu"
        config = DecodeConfig(num_pages=400, **decode_config) if role == "decode" else PREFILL
        w = WorkerProcess(
            role, worker_id, model_dir, config, kv, store_master, device=gpu, dtype="float32"
        )
        started.append(w)
        return w

    yield start
    for w in reversed(started):
        w.stop()


def kv_config(timeout_s: float, connect_timeout_s: float) -> KVTransferConfig:
    return KVTransferConfig(
        store_port=free_port(), timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
    )


def wait_until_sending(router: MiniRouter, p: WorkerProcess) -> None:
    """Pumps the router until the prefill worker has a transfer under way (20 s at most)."""
    deadline = time.monotonic() + 20
    while True:
        router.pump()
        if p.stats().num_sending > 0:
            return
        assert time.monotonic() < deadline, "no transfer under way"
        time.sleep(0.05)


def serve_new_requests(d, d_id, p, p_id, seed: int, count: int, reference) -> None:
    """The pair serves `count` new requests with the reference's tokens."""
    requests = workload(count, seed=seed)
    router = MiniRouter(d, d_id, p, p_id)
    submit_all(router, requests)
    assert_outputs_match(router.run_until_done(60), requests, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_that_never_joins_fails_its_requests_then_a_real_peer_serves(
    backend, workers, reference
):
    kv = kv_config(3.0, 2)
    d = workers("decode", "d0", kv, True, kv_wait_timeout_s=6.0)
    router = MiniRouter(d, "d0", None, "ghost")  # D waits for KV from a peer that never starts
    submit_all(router, workload(3, seed=11, max_len=40))
    start = time.monotonic()
    results = router.run_until_done(30)
    fault_s = time.monotonic() - start
    assert fault_s < 12, f"requests waited {fault_s:.1f} s for a peer that never joined"
    for r in results.values():
        assert r.finish_reason == "abort" and "ghost" in (r.error or ""), r
    assert d.stats().pages_used == 0
    p = workers("prefill", "p0", kv)
    serve_new_requests(d, "d0", p, "p0", 12, 3, reference)
    recovered_s = time.monotonic() - start
    print(
        f"[{backend}] peer never joins: failed in {fault_s:.2f} s, recovered in {recovered_s:.2f} s"
    )
    assert d.stats().pages_used == 0 and p.stats().pages_used == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_worker_killed_mid_receive_frees_prefill_pages_then_a_new_one_serves(
    backend, workers, reference
):
    kv = kv_config(3.0, 2)
    # P holds the store here, so that it outlives the decode worker that is killed.
    p = workers("prefill", "p0", kv, True)
    d = workers("decode", "d0", kv, kv_wait_timeout_s=6.0)
    p.set_send_delay(1.0)  # P sends a header, then pauses: D is killed while it receives
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, workload(3, seed=13, max_len=40))
    wait_until_sending(router, p)
    d.kill()
    start = time.monotonic()
    failures = []
    while p.stats().pages_used:
        failures += p.poll_failures()
        assert time.monotonic() - start < 15, "prefill pages still held after its peer died"
        time.sleep(0.05)
    freed_s = time.monotonic() - start
    failures += p.poll_failures()
    assert failures and all("d0" in f.error for f in failures), failures
    p.set_send_delay(0.0)
    d1 = workers("decode", "d1", kv)
    serve_new_requests(d1, "d1", p, "p0", 14, 3, reference)
    recovered_s = time.monotonic() - start
    print(
        f"[{backend}] decode killed: P freed in {freed_s:.2f} s, recovered in {recovered_s:.2f} s"
    )
    assert d1.stats().pages_used == 0 and p.stats().pages_used == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_worker_killed_mid_send_fails_its_requests_then_a_new_one_serves(
    backend, workers, reference
):
    kv = kv_config(3.0, 4)
    d = workers("decode", "d0", kv, True, kv_wait_timeout_s=60.0)
    p = workers("prefill", "p0", kv)
    p.set_send_delay(60.0)  # P sends a header, then stalls before the pages: killed mid-send
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, workload(4, seed=5, max_len=40))
    wait_until_sending(router, p)
    p.kill()
    start = time.monotonic()
    router.prefill = None  # the router stops talking to the dead worker
    results = router.run_until_done(30)
    fault_s = time.monotonic() - start
    # within the transfer timeout (3 s) plus the time a dead peer gets to rejoin (4 s)
    assert fault_s < 9, f"the survivor failed the requests after {fault_s:.1f} s"
    for r in results.values():
        assert r.finish_reason == "abort" and "p0" in (r.error or ""), r
    assert d.stats().pages_used == 0
    p1 = workers("prefill", "p1", kv)
    serve_new_requests(d, "d0", p1, "p1", 6, 4, reference)
    recovered_s = time.monotonic() - start
    print(
        f"[{backend}] prefill killed: failed in {fault_s:.2f} s, recovered in {recovered_s:.2f} s"
    )
    assert d.stats().pages_used == 0 and p1.stats().pages_used == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stalled_transfer_times_out_then_the_pair_recovers(backend, workers, reference):
    kv = kv_config(2.0, 4)
    d = workers("decode", "d0", kv, True, kv_wait_timeout_s=60.0)
    p = workers("prefill", "p0", kv)
    p.set_send_delay(4.0)  # the receiver waits past its 2 s transfer timeout
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, workload(2, seed=7, max_len=40))
    start = time.monotonic()
    results = router.run_until_done(30)
    fault_s = time.monotonic() - start
    assert fault_s < 10, f"the stalled transfer failed its requests after {fault_s:.1f} s"
    errors = [r.error or "" for r in results.values()]
    assert all(r.finish_reason == "abort" and "p0" in (r.error or "") for r in results.values())
    # The transfer under way times out; one queued behind it fails when P does not rejoin in time.
    assert any("timed out" in e for e in errors), errors
    assert d.stats().pages_used == 0
    deadline = time.monotonic() + 20
    while p.stats().pages_used:
        assert time.monotonic() < deadline, "prefill pages still held after its send failed"
        time.sleep(0.05)
    p.set_send_delay(0.0)
    serve_new_requests(d, "d0", p, "p0", 8, 6, reference)
    recovered_s = time.monotonic() - start
    print(
        f"[{backend}] stalled receiver: failed in {fault_s:.2f} s, recovered in {recovered_s:.2f} s"
    )
    assert d.stats().pages_used == 0 and p.stats().pages_used == 0
