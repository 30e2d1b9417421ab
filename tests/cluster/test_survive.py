"""Surviving a lost worker, on CPU with real Ray and gRPC: worker processes are killed by PID (SIGKILL) under
load. Their requests move to other workers and finish with exactly the offline path's greedy tokens (and
seeded sampling's undisturbed tokens); lost workers are replaced and `pdserve status` records them; no KV page
is left held; a crash loop stops at router.max_restarts. One server serves every test (tests size its pools
themselves); the restart budget is per role, so the crash loop, last, counts the decode restarts before it."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from serving import all_pages_free, greedy, scrape, start_server, wait_for, workload

from pdserve.cli.client import Client, format_status, generate_request
from pdserve.engine import messages
from pdserve.v1 import admin_pb2

MAX_RESTARTS = 5
SEND_TIMEOUT_S = 6.0
"""kvtransfer.timeout_s. A prefill worker's send under way to a lost decode worker fails, freeing its pages,
within kvtransfer.connect_timeout_s (the link to the dead worker is not rebuilt) plus this."""
CONNECT_TIMEOUT_S = 12.0
RESUME_BOUND_S = 5.0
"""A stopped decode worker's streams go on elsewhere within this of the stop (router.heartbeat_timeout_s, its
default, past the deadline of its decode step, then the move)."""
REPLACE_TIMEOUT_S = 90
STREAM_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    with start_server(
        model_dir,
        cluster={"num_decode": 2},
        router={
            "max_restarts": MAX_RESTARTS, "restart_window_s": 3600.0, "metrics_port": 0,
        },
        kvtransfer={"timeout_s": SEND_TIMEOUT_S, "connect_timeout_s": CONNECT_TIMEOUT_S},
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def workers(client: Client, role: int) -> list[admin_pb2.WorkerStatus]:
    return [w for pool in client.status().pools if pool.role == role for w in pool.workers]


def pid_of(server, worker_id: str) -> int:
    handle = server.server.router.workers[worker_id]
    return messages.unwrap(dict, ray.get(handle.actor.ready.remote()))["pid"]


def router_requests(server, worker_id: str) -> int:
    """Requests the router has on the worker now (read in-process: polling over gRPC is too slow to catch
    prompts while they are queued)."""
    w = server.server.router.workers.get(worker_id)
    return 0 if w is None else len(w.requests)


class Streams:
    """Requests streamed on threads; `first_tokens` counts streams that got a token; `arrivals` holds each
    stream's time.monotonic() of every chunk with tokens."""

    def __init__(self, client: Client, requests):
        self.client, self.requests = client, requests
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.arrivals: list[list[float]] = [[] for _ in requests]
        self.first_tokens = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(requests))
        self.futures = [self._pool.submit(self._run, i) for i in range(len(requests))]

    def _run(self, i: int):
        last = None
        try:
            for chunk in self.client.generate(self.requests[i], timeout_s=STREAM_TIMEOUT_S):
                with self._lock:
                    if chunk.token_ids and not self.tokens[i]:
                        self.first_tokens += 1
                    if chunk.token_ids:
                        self.arrivals[i].append(time.monotonic())
                    self.tokens[i].extend(chunk.token_ids)
                last = chunk
        except grpc.RpcError as e:
            return e
        return last

    def results(self) -> list:
        try:
            return [f.result(timeout=STREAM_TIMEOUT_S + 30) for f in self.futures]
        finally:
            self._pool.shutdown()


def ensure_pools(client: Client, num_prefill: int, num_decode: int) -> None:
    client.scale("prefill", num_prefill, timeout_s=REPLACE_TIMEOUT_S)
    client.scale("decode", num_decode, timeout_s=REPLACE_TIMEOUT_S)
    wait_for(lambda: client.is_serving(), 30, "serving")


def wait_replaced(client: Client, victim: str) -> admin_pb2.LostWorker:
    def record():
        found = [w for w in client.status().lost_workers if w.worker_id == victim]
        return found[0] if found and found[0].replaced_by else None

    return wait_for(record, REPLACE_TIMEOUT_S, f"{victim} replaced", interval_s=0.5)


def wait_pages_free(client: Client) -> None:
    try:
        wait_for(lambda: all_pages_free(client), CONNECT_TIMEOUT_S + SEND_TIMEOUT_S + 15, "")
    except TimeoutError:
        raise AssertionError(f"KV pages still held:\n{format_status(client.status())}") from None


def check_finished(results, requests, expected) -> None:
    failed = [r for r in results if isinstance(r, grpc.RpcError)]
    assert not failed, [(e.code(), e.details()) for e in failed]
    for request, result, tokens, want in zip(requests, results, *expected, strict=True):
        assert tokens == want, request.request_id
        assert result.usage.completion_tokens == len(want)


def greedy_and_seeded(client: Client, reference, prompts, max_tokens: int, num_seeded: int):
    """Greedy requests for `prompts` with offline's tokens, then seeded sampling requests for the first
    `num_seeded` with their tokens in an undisturbed run on the same server: (requests, expected tokens)."""
    requests = [greedy(p, max_tokens, request_id=f"greedy{i}") for i, (p, _) in enumerate(prompts)]
    expected = [reference(p, max_tokens) for p, _ in prompts]
    sampled = [
        generate_request(p, max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=7 + i,
                         ignore_eos=True, request_id=f"seeded{i}")
        for i, (p, _) in enumerate(prompts[:num_seeded])
    ]  # fmt: skip
    if not sampled:
        return requests, expected
    undisturbed = Streams(client, sampled)
    undisturbed.results()
    return requests + sampled, expected + undisturbed.tokens


def test_decode_worker_killed_mid_stream(server, client, reference):
    ensure_pools(client, 1, 2)
    prompts = workload(16, seed=31, max_len=80)
    requests, expected = greedy_and_seeded(client, reference, prompts, 48, num_seeded=4)

    victim = max(workers(client, admin_pb2.ROLE_DECODE), key=lambda w: w.num_requests).worker_id
    pid = pid_of(server, victim)
    streams = Streams(client, requests)
    wait_for(
        lambda: router_requests(server, victim) >= 4 and streams.first_tokens >= 4,
        60, f"streams running on {victim}", interval_s=0.01,
    )  # fmt: skip
    os.kill(pid, signal.SIGKILL)
    check_finished(streams.results(), requests, [streams.tokens, expected])

    record = wait_replaced(client, victim)
    assert record.role == admin_pb2.ROLE_DECODE and record.num_requests_migrated >= 1
    assert record.reason
    decodes = workers(client, admin_pb2.ROLE_DECODE)
    assert record.replaced_by in {w.worker_id for w in decodes} and victim not in {
        w.worker_id for w in decodes
    }
    assert all(w.state == admin_pb2.WORKER_STATE_SERVING for w in decodes) and len(decodes) == 2
    status = client.status()
    assert status.num_requests_migrated >= record.num_requests_migrated
    text = format_status(status)
    assert f"{victim}" in text and f"replaced by {record.replaced_by}" in text
    wait_pages_free(client)


def test_single_decode_worker_killed_streams_wait_for_its_replacement(server, client, reference):
    ensure_pools(client, 1, 1)
    prompts = workload(8, seed=32, max_len=60)
    requests, expected = greedy_and_seeded(client, reference, prompts, 40, num_seeded=2)
    (victim,) = [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)]
    pid = pid_of(server, victim)
    streams = Streams(client, requests)
    wait_for(lambda: streams.first_tokens >= 6, 60, "streams running", interval_s=0.01)
    os.kill(pid, signal.SIGKILL)
    check_finished(streams.results(), requests, [streams.tokens, expected])
    record = wait_replaced(client, victim)
    assert record.num_requests_migrated >= 1
    assert [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)] == [record.replaced_by]
    assert client.is_serving()
    wait_pages_free(client)


def streams_on(server, worker_id: str) -> set[str]:
    """The client request ids of the requests the router has on the worker now (read in-process)."""
    router = server.server.router
    w = router.workers[worker_id]
    return {router.requests[r].client_id for r in list(w.requests) if r in router.requests}


def test_a_stopped_decode_worker_is_lost_past_its_step_deadline(server, client, reference):
    ensure_pools(client, 1, 2)
    prompts = workload(6, seed=35, max_len=60)
    requests, expected = greedy_and_seeded(client, reference, prompts, 64, num_seeded=0)
    victim = workers(client, admin_pb2.ROLE_DECODE)[0].worker_id
    pid = pid_of(server, victim)
    streams = Streams(client, requests)
    wait_for(
        lambda: router_requests(server, victim) >= 1 and streams.first_tokens >= 2,
        60, f"streams running on {victim}", interval_s=0.01,
    )  # fmt: skip
    os.kill(pid, signal.SIGSTOP)  # alive but silent: only the heartbeat tells
    stopped = time.monotonic()
    moved = streams_on(server, victim)
    try:
        check_finished(streams.results(), requests, [streams.tokens, expected])
        record = wait_replaced(client, victim)
    finally:  # the supervisor killed it already; a failed test must not leave it stopped
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert "no answer" in record.reason and "router.heartbeat_timeout_s" in record.reason
    (lost,) = [x for x in server.server.supervisor.lost if x.worker.worker_id == victim]
    heartbeat_timeout_s = server.server.config.router.heartbeat_timeout_s
    assert (
        lost.lost_at - stopped < heartbeat_timeout_s + 1.0
    )  # its decode step's deadline is far shorter
    assert len(workers(client, admin_pb2.ROLE_DECODE)) == 2
    # each stream that was on the stopped worker and not done then got its next tokens from another worker
    resumed = {
        r.request_id: next(t for t in times if t > stopped) - stopped
        for r, times in zip(requests, streams.arrivals, strict=True)
        if r.request_id in moved and any(t > stopped for t in times)
    }
    assert resumed, f"no stream of {victim} was left to move: {moved}"
    print(f"stop to resume: {max(resumed.values()):.2f}s (per stream: {resumed})")
    assert max(resumed.values()) < RESUME_BOUND_S, resumed
    wait_pages_free(client)


@pytest.mark.parametrize("num_prefill", [2, 1])
def test_prefill_worker_killed_with_prompts_queued(server, client, reference, num_prefill):
    ensure_pools(client, num_prefill, 1)
    prompts = workload(16, seed=33 + num_prefill, max_len=250)
    requests, expected = greedy_and_seeded(client, reference, prompts, 8, num_seeded=2)
    prefills = [w.worker_id for w in workers(client, admin_pb2.ROLE_PREFILL)]
    pids = {w: pid_of(server, w) for w in prefills}
    streams = Streams(client, requests)
    victim = wait_for(
        lambda: next((w for w in prefills if router_requests(server, w) >= 2), None),
        60, "prompts queued on a prefill worker", interval_s=0.005,
    )  # fmt: skip
    os.kill(pids[victim], signal.SIGKILL)
    check_finished(streams.results(), requests, [streams.tokens, expected])
    record = wait_replaced(client, victim)
    assert record.role == admin_pb2.ROLE_PREFILL and record.num_requests_migrated >= 1
    assert len(workers(client, admin_pb2.ROLE_PREFILL)) == num_prefill
    wait_pages_free(client)


def test_crash_loop_stops_at_the_restart_bound(server, client, reference):
    ensure_pools(client, 1, 1)
    lost = [w for w in client.status().lost_workers if w.role == admin_pb2.ROLE_DECODE]
    done = sum(1 for w in lost if w.replaced_by)
    assert done < MAX_RESTARTS
    for _ in range(MAX_RESTARTS - done):
        (victim,) = [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)]
        os.kill(pid_of(server, victim), signal.SIGKILL)
        wait_replaced(client, victim)
    (victim,) = [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)]
    os.kill(pid_of(server, victim), signal.SIGKILL)
    status = wait_for(lambda: (s := client.status()).restarts_stopped and s, 30, "restarts stopped")
    assert f"router.max_restarts={MAX_RESTARTS}" in status.restarts_stopped
    assert victim in status.restarts_stopped
    (record,) = [w for w in status.lost_workers if w.worker_id == victim]
    assert not record.replaced_by and record.not_replaced == status.restarts_stopped
    assert status.num_workers_replaced == sum(1 for w in status.lost_workers if w.replaced_by)
    assert status.restarts_stopped in format_status(status)
    # the same counts in /metrics
    families = scrape(f"http://127.0.0.1:{server.server.metrics_port}/metrics")

    def total(name: str) -> float:
        return sum(s.value for s in families[name].samples if s.name == f"{name}_total")

    assert total("pdserve:workers_lost") == status.num_workers_lost > 0
    assert total("pdserve:workers_replaced") == status.num_workers_replaced
    assert total("pdserve:requests_migrated") == status.num_requests_migrated
    # every moved stream of the earlier tests got its next token: one migration time each at most
    (resumed,) = [
        s.value for s in families["pdserve:request_migration_seconds"].samples
        if s.name == "pdserve:request_migration_seconds_count"
    ]  # fmt: skip
    assert 0 < resumed <= status.num_requests_migrated
    assert not workers(client, admin_pb2.ROLE_DECODE)
    wait_for(lambda: not client.is_serving(), 10, "NOT_SERVING with no decode worker")
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(greedy([0, 5], 3), timeout_s=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "restarts stopped" in info.value.details()
    # The operator brings the pool back.
    (added,) = client.scale("decode", 1, timeout_s=REPLACE_TIMEOUT_S).added
    wait_for(lambda: client.is_serving(), 10, "SERVING again")
    chunks = list(client.generate(greedy([0, 5], 3), timeout_s=60))
    assert [t for c in chunks for t in c.token_ids] == reference([0, 5], 3)
    assert chunks[-1].timings.decode_worker == added
