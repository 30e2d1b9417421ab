"""Aggregated serving (no prefill pool) with a small KV cache: a request that does not fit now waits for a bounded
time, then gets RESOURCE_EXHAUSTED while the running one is untouched; one that can never fit is INVALID_ARGUMENT."""

from __future__ import annotations

import time

import grpc
import pytest
from serving import all_pages_free, collect, greedy, start_server, wait_for

from pdserve.cli.client import Client

NUM_PAGES = 64  # 1024 tokens in pages of 16 (set here: the default page is 64)
ADMISSION_TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def client(ray_cluster, model_dir):
    with start_server(
        model_dir,
        cluster={"num_prefill": 0},
        prefill={"page_size": 16},  # both pools' pages must agree
        decode={"num_pages": NUM_PAGES, "page_size": 16},
        router={"admission_timeout_s": ADMISSION_TIMEOUT_S},
    ) as server, Client(server.address) as client:  # fmt: skip
        yield client


def test_no_room_now_is_resource_exhausted_after_the_admission_wait(client, reference):
    big = [0, *[(5 * i) % 900 + 3 for i in range(699)]]  # 44 pages now, 64 when done
    call = client.generate(greedy(big, 1024 - len(big)), timeout_s=120)
    first = next(call)  # admitted and running
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy([0, *range(3, 402)], 8))  # 25 pages: more than are free
    waited = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "no decode worker had room" in info.value.details()
    assert waited >= ADMISSION_TIMEOUT_S
    rest = list(call)
    assert [t for c in [first, *rest] for t in c.token_ids] == reference(big, 1024 - len(big))
    assert rest[-1].timings.prefill_worker == ""  # aggregated: the decode worker prefilled it
    wait_for(lambda: all_pages_free(client), 10, "pages freed")
    chunks = collect(client, greedy([0, *range(3, 402)], 8))  # fits now
    assert chunks[-1].usage.completion_tokens == 8


def test_never_fits_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy([0, 1, 2], 2000))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in info.value.details() and "KV pages" in info.value.details()
