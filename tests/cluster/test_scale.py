"""Scaling a running service on CPU (real Ray, real gRPC): a decode worker added by ScalePool serves requests;
shrinking back drains one without failing its requests; prefill 1 -> 0 -> 1 switches to aggregated serving and back;
admin errors name what is wrong; with router.migration_limit 0 a lost worker's requests fail (and it is replaced)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from serving import all_pages_free, collect, greedy, start_server, wait_for, workload

from pdserve.cli.client import Client
from pdserve.v1 import admin_pb2, generation_pb2


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    with start_server(model_dir, router={"migration_limit": 0}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def workers(client: Client, role: int) -> list[admin_pb2.WorkerStatus]:
    (pool,) = [p for p in client.status().pools if p.role == role]
    return list(pool.workers)


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def run_all(client: Client, requests, prefix: str):
    def run(i: int):
        prompt, max_tokens = requests[i]
        return collect(client, greedy(prompt, max_tokens, request_id=f"{prefix}{i}"))

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, range(len(requests))))


def test_scale_decode_up_then_drain_without_failing_requests(client, reference):
    reply = client.scale("decode", 2, timeout_s=120)
    assert list(reply.added) == ["decode-1"] and not reply.removed
    assert [w.state for w in workers(client, admin_pb2.ROLE_DECODE)] == [
        admin_pb2.WORKER_STATE_SERVING
    ] * 2

    # The new worker holds the most free pages: it takes requests at once.
    requests = workload(8, seed=11)
    results = run_all(client, requests, "up")
    served_by = {chunks[-1].timings.decode_worker for chunks in results}
    assert served_by == {"decode-0", "decode-1"}
    for (prompt, max_tokens), chunks in zip(requests, results, strict=True):
        assert tokens(chunks) == reference(prompt, max_tokens)

    # Long requests on both workers, then shrink to one while they run: none fails.
    long_requests = [(prompt, 160) for prompt, _ in workload(8, seed=12, max_len=40)]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, client, long_requests, "drain")
        wait_for(
            lambda: all(w.num_requests > 0 for w in workers(client, admin_pb2.ROLE_DECODE)),
            30, "requests running on both decode workers",
        )  # fmt: skip
        reply = client.scale("decode", 1, timeout_s=120)
        results = running.result(timeout=120)
    assert len(reply.removed) == 1 and not reply.added
    for (prompt, max_tokens), chunks in zip(long_requests, results, strict=True):
        assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert tokens(chunks) == reference(prompt, max_tokens)
    assert {chunks[-1].timings.decode_worker for chunks in results} == {"decode-0", "decode-1"}
    assert [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)] != list(reply.removed)
    assert len(workers(client, admin_pb2.ROLE_DECODE)) == 1
    wait_for(lambda: all_pages_free(client), 10, "pages freed")


def test_prefill_pool_to_zero_is_aggregated_and_back(client, reference):
    prompt = [0, *range(40, 90)]
    reply = client.scale("prefill", 0, timeout_s=120)
    assert reply.removed and not reply.pool.workers
    assert client.status().aggregated
    chunks = collect(client, greedy(prompt, 10))
    assert tokens(chunks) == reference(prompt, 10)
    assert chunks[-1].timings.prefill_worker == ""

    reply = client.scale("prefill", 1, timeout_s=120)
    (added,) = reply.added
    chunks = collect(client, greedy(prompt, 10))
    assert tokens(chunks) == reference(prompt, 10)
    assert chunks[-1].timings.prefill_worker == added
    wait_for(lambda: all_pages_free(client), 10, "pages freed")


def test_admin_errors_name_the_problem(client):
    with pytest.raises(grpc.RpcError) as info:
        client.drain("decode-99")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "decode-99" in info.value.details()
    (last,) = workers(client, admin_pb2.ROLE_DECODE)
    with pytest.raises(grpc.RpcError) as info:
        client.drain(last.worker_id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        client.scale("decode", 0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.is_serving()


def test_lost_decode_worker_past_the_migration_limit_fails_only_its_requests(
    server, client, reference
):
    import ray

    (victim,) = client.scale("decode", 2, timeout_s=120).added
    survivors = [
        w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE) if w.worker_id != victim
    ]
    requests = [(prompt, 400) for prompt, _ in workload(6, seed=13, max_len=40)]

    def run(i: int):
        prompt, max_tokens = requests[i]
        try:
            return collect(client, greedy(prompt, max_tokens, request_id=f"lost{i}"))
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(run, i) for i in range(len(requests))]
        wait_for(
            lambda: {w.worker_id: w.num_requests for w in workers(client, admin_pb2.ROLE_DECODE)}
            .get(victim, 0) > 0,
            30, f"requests running on {victim}",
        )  # fmt: skip
        ray.kill(server.server.router.workers[victim].actor)
        results = [f.result(timeout=120) for f in futures]
    failed = [r for r in results if isinstance(r, grpc.RpcError)]
    assert failed, "the killed worker's requests must fail"
    for error in failed:
        assert error.code() == grpc.StatusCode.UNAVAILABLE and victim in error.details()
        assert "router.migration_limit=0" in error.details()
    for (prompt, max_tokens), result in zip(requests, results, strict=True):
        if not isinstance(result, grpc.RpcError):
            assert tokens(result) == reference(prompt, max_tokens)
    replacement = wait_for(
        lambda: next((w.replaced_by for w in client.status().lost_workers if w.replaced_by), None),
        90, f"{victim} replaced",
    )  # fmt: skip
    decodes = [w.worker_id for w in workers(client, admin_pb2.ROLE_DECODE)]
    assert sorted(decodes) == sorted([*survivors, replacement])
    assert client.is_serving()
    chunks = collect(client, greedy([0, 5], 3))
    assert tokens(chunks) == reference([0, 5], 3)
    wait_for(lambda: all_pages_free(client), 15, "pages freed on the survivors")
