"""Aggregated serving by a decode worker of 2 CPU ranks (data-parallel attention + expert-parallel MoE, gloo,
with expert balancing and two-batch overlap on): rank 0 in the worker's actor, rank 1 a Ray actor on the
second bundle of the worker's placement group. Greedy outputs equal `pdserve offline`'s, while copies of hot
experts move; killing the rank's process loses the worker as a whole: it is replaced (same layout, new name),
its requests finish there equal to offline, and no request or page is left held."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from serving import all_pages_free, collect, greedy, start_server, wait_for, workload

from pdserve.cli.client import Client
from pdserve.engine import messages
from pdserve.v1 import admin_pb2

LAYOUT = {
    "ranks": 2, "attention": "data", "expert_parallel": 2,
    "redundant_experts": 2, "rebalance_steps": 3, "overlap_rows": 2,
}  # fmt: skip
"""With expert balancing (copies placed every 3 steps) and two-batch overlap on: as a user turns them on."""


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    with start_server(
        model_dir,
        cluster={"num_prefill": 0},
        prefill={"page_size": 16},  # both pools' pages must agree
        decode={"num_pages": 128, "page_size": 16, **LAYOUT},
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def decode_workers(client: Client):
    return [w for pool in client.status().pools for w in pool.workers
            if pool.role == admin_pb2.ROLE_DECODE]  # fmt: skip


def test_greedy_outputs_equal_offline(server, client, reference):
    requests = workload(6, seed=21, max_len=60)
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: collect(client, greedy(*r)), requests))
    for (prompt, max_tokens), chunks in zip(requests, results, strict=True):
        assert tokens(chunks) == reference(prompt, max_tokens)
    wait_for(lambda: all_pages_free(client), 10, "pages freed")
    (worker,) = decode_workers(client)
    handle = server.server.router.workers[worker.worker_id]
    wait_for(
        lambda: handle.stats is not None and handle.stats.expert_slots_moved > 0, 10,
        "copies of hot experts placed and moved",
    )  # fmt: skip


def test_killing_a_rank_loses_the_worker_and_its_requests_finish_on_the_replacement(
    server, client, reference
):
    (worker,) = decode_workers(client)
    handle = server.server.router.workers[worker.worker_id]
    (rank_pid,) = messages.unwrap(dict, ray.get(handle.actor.ready.remote()))["rank_pids"]
    requests = [(prompt, 160) for prompt, _ in workload(3, seed=5, max_len=30)]

    def run(prompt, max_tokens):
        try:
            return collect(client, greedy(prompt, max_tokens), timeout_s=120)
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(run, *r) for r in requests]
        wait_for(lambda: decode_workers(client)[0].num_requests == len(requests), 30, "running")
        os.kill(rank_pid, signal.SIGKILL)
        results = [f.result(timeout=150) for f in futures]
    for (prompt, max_tokens), result in zip(requests, results, strict=True):
        assert not isinstance(result, grpc.RpcError), (result.code(), result.details())
        assert tokens(result) == reference(prompt, max_tokens)
    status = client.status()
    (lost,) = [w for w in status.lost_workers if w.worker_id == worker.worker_id]
    assert lost.num_requests_migrated == len(requests)
    (replacement,) = decode_workers(client)
    assert replacement.worker_id == lost.replaced_by != worker.worker_id
    assert replacement.state == admin_pb2.WORKER_STATE_SERVING
    wait_for(lambda: all_pages_free(client), 15, "no request or page held")
