"""MTP speculation served: a 1P1D server with `speculative.num_tokens` (the prefill worker fills the MTP module's
cache and sends a draft with the first token; the decode worker verifies drafts in its batch) gives each greedy
stream the tokens of the offline path at one token a step, in batch-invariant mode, with concurrent sampled
streams in the same batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import all_pages_free, collect, greedy, start_server, wait_for, workload

from pdserve import kernels
from pdserve.cli.client import Client, generate_request
from pdserve.engine.offline import generate_greedy


@pytest.fixture(scope="module")
def offline(reference_model):
    def expected(prompt, max_tokens):
        with kernels.use_batch_invariant():
            return generate_greedy(reference_model, prompt, max_tokens)

    return expected


def test_speculative_1p1d_streams_equal_offline(ray_cluster, model_dir, offline):
    requests = workload(12, seed=4, max_len=80)
    with (
        start_server(
            model_dir, model={"batch_invariant": True}, speculative={"num_tokens": 2}
        ) as server,
        Client(server.address) as client,
    ):

        def run(i: int):
            prompt, max_tokens = requests[i]
            if i % 3 == 2:  # a sampled stream in the same batches
                return collect(client, generate_request(
                    prompt, max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i,
                    ignore_eos=True,
                ))  # fmt: skip
            return collect(client, greedy(prompt, max_tokens, request_id=f"s{i}"))

        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(run, range(len(requests))))
        for i, ((prompt, max_tokens), chunks) in enumerate(zip(requests, results, strict=True)):
            tokens = [t for c in chunks for t in c.token_ids]
            assert len(tokens) == max_tokens
            if i % 3 != 2:
                assert tokens == offline(prompt, max_tokens), i
        wait_for(lambda: all_pages_free(client), 10, "pages freed after the requests finished")
