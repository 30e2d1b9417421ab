"""`pdserve serve --model.kv-cache-dtype fp8` end to end on CPU: real Ray actors, the real gRPC router. Both workers
keep fp8 rows (the prefill worker's pages reach the decode worker as they are), and the streamed tokens equal the
offline path's over an fp8 cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from serving import start_server, wait_for, workload

from pdserve.cli.client import Client, generate_request
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import load_model

# each prompt prefilled in one piece, as the offline path prefills it (a piece after the first would read
# the earlier ones as fp8 rows, the offline path as they were computed)
WHOLE_PROMPTS = {"max_prefill_chunk": 4096, "max_num_batched_tokens": 4096}


@pytest.fixture(scope="module")
def client(ray_cluster, model_dir):
    server = start_server(model_dir, model={"kv_cache_dtype": "fp8"}, prefill=WHOLE_PROMPTS)
    with server, Client(server.address) as client:
        yield client


def test_streams_equal_offline_on_fp8_rows(client, model_dir, reference):
    requests = workload(8, seed=5)
    offline = OfflineGenerator(load_model(model_dir, dtype=torch.float32), kv_cache_dtype="fp8")
    expected = [
        offline.generate(p, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids
        for p, n in requests
    ]
    # the fp8 rows change some greedy tokens: the service matches only by reading fp8 rows
    assert any(e != reference(p, n) for e, (p, n) in zip(expected, requests, strict=True))

    def run(i: int) -> list[int]:
        prompt, max_tokens = requests[i]
        request = generate_request(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, request_id=f"f{i}"
        )
        return [t for c in client.generate(request, timeout_s=120) for t in c.token_ids]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == expected
    assert client.status().kv_cache_dtype == "fp8"  # what `pdserve status` shows operators
    wait_for(
        lambda: not any(w.kv_pages_used for pool in client.status().pools for w in pool.workers),
        10, "pages freed",
    )  # fmt: skip


def test_aggregated_prefill_on_fp8_rows_equals_offline(client, model_dir):
    """Without prefill workers the decode worker prefills prompts itself, writing fp8 rows, in pieces of
    decode.max_prefill_chunk (128 here) that read the earlier pieces back as fp8 rows: as the offline path does
    with the same pieces."""
    reply = client.scale("prefill", 0, timeout_s=120)
    assert reply.removed and client.status().aggregated
    try:
        offline = OfflineGenerator(
            load_model(model_dir, dtype=torch.float32), prefill_chunk=128, kv_cache_dtype="fp8"
        )
        for prompt in ([0, *range(40, 90)], [0, *range(7, 306)]):
            expected = offline.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
            request = generate_request(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
            chunks = list(client.generate(request, timeout_s=120))
            assert [t for c in chunks for t in c.token_ids] == expected.token_ids
            assert chunks[-1].timings.prefill_worker == ""
    finally:
        client.scale("prefill", 1, timeout_s=120)
