"""Disaggregated serving with workers of several CPU ranks (gloo): a prefill worker of 2 ranks (tensor-parallel
attention and dense layers; the latent cache is the same on both ranks, and rank 0 sends it) and a decode worker
of 2 ranks (data-parallel attention, expert-parallel MoE; each rank receives the KV pages of its own requests):
greedy outputs equal `pdserve offline`'s, both decode ranks take requests, and every page comes back on both
sides."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from pdserve.cluster.client import Client
from pdserve.engine import messages

from .conftest import start_server, wait_for, workload
from .test_generate import all_pages_free, collect, greedy


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    with start_server(
        model_dir,
        prefill={"ranks": 2, "attention": "tensor", "dense": "tensor"},
        decode={"ranks": 2, "attention": "data", "expert_parallel": 2},
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def test_tp2_prefill_to_dp2_ep2_decode_outputs_equal_offline(server, client, reference):
    rank_pids = {
        w.role: messages.unwrap(dict, ray.get(w.actor.ready.remote()))["rank_pids"]
        for w in server.server.router.workers.values()
    }
    assert {role: len(pids) for role, pids in rank_pids.items()} == {"prefill": 1, "decode": 1}
    requests = workload(6, seed=33, max_len=80)
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: collect(client, greedy(*r)), requests))
    for (prompt, max_tokens), chunks in zip(requests, results, strict=True):
        assert [t for c in chunks for t in c.token_ids] == reference(prompt, max_tokens)
        assert chunks[
            -1
        ].timings.prefill_worker  # prefilled by the prefill worker, not the decode one
    wait_for(lambda: all_pages_free(client), 10, "pages freed")
