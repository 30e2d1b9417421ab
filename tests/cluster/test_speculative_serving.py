"""MTP speculation served: a 1P1D server with `speculative.num_tokens` (the prefill worker fills the MTP module's
cache and sends a draft with the first token; the decode worker verifies drafts in its batch) gives each greedy
stream the tokens of the offline path at one token a step, in batch-invariant mode, with concurrent sampled
streams in the same batches. Each stream's last chunk says what speculation did for it (gRPC's
`usage.speculative`, the OpenAI usage's `speculative`), and /metrics' `spec_decode` counters of the decode
worker grow by what its requests report."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import all_pages_free, collect, greedy, scrape, start_server, wait_for, workload

from pdserve import kernels
from pdserve.cli.client import Client, generate_request
from pdserve.engine.offline import generate_greedy

NUM_DRAFTS = 2
SPEC = "pdserve:spec_decode_num"


@pytest.fixture(scope="module")
def offline(reference_model):
    def expected(prompt, max_tokens):
        with kernels.use_batch_invariant():
            return generate_greedy(reference_model, prompt, max_tokens)

    return expected


def spec_counters(url: str) -> dict[str, float] | None:
    """The decode workers' speculation counters summed (per position: `per_pos_<p>`), None before the first
    stats poll brought any."""
    families = scrape(url)
    out: dict[str, float] = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"):
        for s in families[f"{SPEC}_{name}"].samples:
            key = f"per_pos_{s.labels['position']}" if "position" in s.labels else name
            out[key] = out.get(key, 0) + s.value
    return out or None


def test_speculative_1p1d_streams_equal_offline_and_report_their_drafts(
    ray_cluster, model_dir, offline
):
    requests = workload(12, seed=4, max_len=80)
    with (
        start_server(
            model_dir, model={"batch_invariant": True}, speculative={"num_tokens": NUM_DRAFTS},
            router={"http_port": 0},
            # every step drafts: the random MTP module's drafts would switch drafting off (SpecPolicy)
            decode={"speculative_min_acceptance": 0.0},
        ) as server,
        Client(server.address) as client,
    ):  # fmt: skip
        metrics_url = f"{server.http_url.removesuffix('/v1')}/metrics"
        # the first stats poll comes after the warm-up: its counts are the baseline
        before = wait_for(
            lambda: spec_counters(metrics_url), 10, "speculation counters in /metrics"
        )

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
        drafted = accepted = 0
        for i, ((prompt, max_tokens), chunks) in enumerate(zip(requests, results, strict=True)):
            tokens = [t for c in chunks for t in c.token_ids]
            assert len(tokens) == max_tokens
            if i % 3 != 2:
                assert tokens == offline(prompt, max_tokens), i
            # every request decodes past its first token: its decode steps verified drafts
            usage = chunks[-1].usage
            assert usage.HasField("speculative"), i
            spec = usage.speculative
            assert spec.draft_tokens > 0 and spec.accepted_tokens <= spec.draft_tokens, i
            assert spec.accepted_tokens < max_tokens, i
            assert 1.0 <= spec.mean_accepted_length <= 1 + NUM_DRAFTS, i
            drafted += spec.draft_tokens
            accepted += spec.accepted_tokens
            assert not any(c.usage.HasField("speculative") for c in chunks[:-1]), i

        # The OpenAI usage object, whole.
        prompt, _ = requests[0]
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = urllib.request.urlopen(
            urllib.request.Request(
                f"{server.http_url}/completions", json.dumps(body).encode(),
                {"content-type": "application/json"},
            ),
            timeout=60,
        )  # fmt: skip
        http = json.loads(reply.read())["usage"]["speculative"]
        assert set(http) == {"draft_tokens", "accepted_tokens", "mean_accepted_length"}
        assert http["draft_tokens"] > 0 and http["accepted_tokens"] <= http["draft_tokens"]
        drafted += http["draft_tokens"]
        accepted += http["accepted_tokens"]

        # /metrics: the decode worker's counters grew by exactly what its requests reported.
        def grown():
            now = spec_counters(metrics_url)
            delta = {k: v - before.get(k, 0) for k, v in now.items()}
            done = (delta["draft_tokens"], delta["accepted_tokens"]) == (drafted, accepted)
            return done and delta

        delta = wait_for(grown, 10, f"counters grown by {drafted} drafts, {accepted} accepted")
        positions = [delta[f"per_pos_{p}"] for p in range(NUM_DRAFTS)]
        assert sum(positions) == accepted and positions[0] >= positions[1]
        assert drafted / NUM_DRAFTS <= delta["drafts"] <= drafted  # 1 to NUM_DRAFTS drafts a step
        wait_for(lambda: all_pages_free(client), 10, "pages freed after the requests finished")
