"""A prefill worker and a decode worker in two OS processes, KV pages over real torch.distributed (gloo): outputs
equal `pdserve offline`'s, the first output carries what P sent with the KV, and pages all come back. Transfer
faults (a killed peer, a stalled transfer, a peer that never joins) are tests/workers/test_transfer_faults.py's,
on gloo and NCCL."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from pdserve.decode import DecodeConfig
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig
from pdserve.model.loader import load_model
from pdserve.prefill import PrefillConfig

from .harness import MiniRouter
from .procs import WorkerProcess

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

PREFILL = PrefillConfig(num_pages=400, max_prefill_chunk=64, max_num_batched_tokens=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(n: int, seed: int, max_len: int = 300) -> dict[str, tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        length = 1 + int(torch.randint(0, max_len, (1,), generator=g))
        prompt = [0, *torch.randint(3, 1000, (length - 1,), generator=g).tolist()]
        out[f"req-{seed}-{i}"] = (prompt, 4 + (7 * i) % 29)
    return out


def submit_all(router: MiniRouter, requests) -> None:
    for request_id, (prompt, max_tokens) in requests.items():
        router.submit(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def assert_outputs_match(results, requests, reference) -> None:
    for request_id, (prompt, max_tokens) in requests.items():
        r = results[request_id]
        assert r.error is None and r.finish_reason == "length", (request_id, r)
        assert r.token_ids == reference(prompt, max_tokens), request_id


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


@pytest.fixture
def cluster(model_dir):
    """Starts P and D processes on demand; stops them all after the test."""
    started: list[WorkerProcess] = []
    port = free_port()

    def start(
        decode_pages=400, kv_timeout_s=30.0, kv_wait_timeout_s=60.0, prefill_id="p0",
        prefill=PREFILL, kv_cache_dtype="auto", prefill_kv_cache_dtype=None,
    ):  # fmt: skip
        kv = KVTransferConfig(store_port=port, timeout_s=kv_timeout_s, connect_timeout_s=4)
        master = not started
        d = None
        if master:
            d = WorkerProcess(
                "decode", "d0", model_dir,
                DecodeConfig(num_pages=decode_pages, kv_wait_timeout_s=kv_wait_timeout_s), kv, True,
                kv_cache_dtype=kv_cache_dtype,
            )  # fmt: skip
            started.append(d)
        p_dtype = prefill_kv_cache_dtype or kv_cache_dtype
        p = WorkerProcess("prefill", prefill_id, model_dir, prefill, kv, kv_cache_dtype=p_dtype)
        started.append(p)
        return p, (d or started[0])

    yield start
    for w in started:
        w.stop()


def test_disaggregated_outputs_equal_offline(cluster, reference):
    p, d = cluster()
    requests = workload(16, seed=1)
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, requests)
    assert_outputs_match(router.run_until_done(120), requests, reference)
    assert p.stats().pages_used == 0 and d.stats().pages_used == 0


def test_the_first_output_carries_what_the_prefill_worker_sent_with_the_kv(cluster, reference):
    """Over torch.distributed (gloo): each request's first output from D carries its first token's
    log-probabilities (sampled on P) and P's stage times with the transfer's; its last output adds D's wait
    for the first decode step."""
    p, d = cluster()
    requests = workload(4, seed=9)
    router = MiniRouter(d, "d0", p, "p0")
    for request_id, (prompt, max_tokens) in requests.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        router.submit(request_id, prompt, params)
    results = router.run_until_done(120)
    assert_outputs_match(results, requests, reference)
    for r in results.values():
        first, stages = r.first, r.first.stages
        assert first.token_ids == r.token_ids[:1] and len(first.logprobs) == 1
        # greedy sampling: the token is the most likely one, whose log-probability comes first
        assert first.logprobs[0].top_ids == (r.token_ids[0], first.logprobs[0].top_ids[1])
        assert first.logprobs[0].logprob == first.logprobs[0].top_logprobs[0] <= 0
        assert stages.prefill_queue_s > 0 and stages.prefill_s > 0 and stages.kv_transfer_s > 0
        assert stages.decode_queue_s == 0
        assert r.last.stages == dataclasses.replace(
            stages, decode_queue_s=r.last.stages.decode_queue_s
        )
        assert r.last.stages.decode_queue_s > 0
    assert p.stats().pages_used == 0 and d.stats().pages_used == 0


def test_fp8_cache_disaggregated_outputs_equal_offline(cluster, model_dir, reference):
    """Both workers keep fp8 rows; P's pages reach D as they are. Each prompt is prefilled in one piece
    (a large token budget), as the offline path prefills it, so the outputs are the same tokens."""
    whole = PrefillConfig(num_pages=400, max_prefill_chunk=4096, max_num_batched_tokens=4096)
    p, d = cluster(prefill=whole, kv_cache_dtype="fp8")
    requests = workload(8, seed=4)
    offline = OfflineGenerator(load_model(model_dir, dtype=torch.float32), kv_cache_dtype="fp8")
    expected = {
        prompt_key(prompt, n): offline.generate(
            prompt, SamplingParams(max_tokens=n, ignore_eos=True)
        )
        for prompt, n in requests.values()
    }
    # the fp8 rows change some greedy tokens: the workers can only match by reading fp8 rows too
    assert any(expected[prompt_key(*r)].token_ids != reference(*r) for r in requests.values())
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, requests)
    results = router.run_until_done(120)
    assert_outputs_match(results, requests, lambda *r: expected[prompt_key(*r)].token_ids)
    assert p.stats().pages_used == 0 and d.stats().pages_used == 0


def test_mismatched_cache_formats_fail_the_requests_then_pages_free(cluster):
    """A prefill worker on bf16 rows and a decode worker on fp8 rows (a server never pairs them; a hand-built
    deployment might): D refuses the first header for its value size, fails that transfer naming both sizes
    and kv_cache_dtype, and drops the link, so the requests fail within the timeouts instead of waiting for
    pages, and every page comes back on both sides. (Which error a request gets depends on which side reports
    first: the others name the dropped link.)"""
    p, d = cluster(kv_cache_dtype="fp8", prefill_kv_cache_dtype="auto", kv_wait_timeout_s=20.0)
    requests = workload(3, seed=6)
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, requests)
    results = router.run_until_done(90)
    for request_id in requests:
        assert results[request_id].error is not None, results[request_id]
    wait_for(lambda: p.stats().pages_used == 0 and d.stats().pages_used == 0, 30, "pages freed")


def prompt_key(prompt: list[int], max_tokens: int) -> tuple:
    return tuple(prompt), max_tokens


SMALL_POOL = 12
"""Decode pages (64 tokens each) that the growing workload outgrows: 8 requests of up to 4 pages each."""


def growing_workload(seed: int) -> dict[str, tuple[list[int], int]]:
    """Short prompts that all grow long: admitted together, they outgrow a small page pool."""
    return {
        k: (prompt, 70 + 10 * i) for i, (k, (prompt, _)) in enumerate(workload(8, seed, 60).items())
    }


def test_preemption_by_recompute_keeps_outputs(cluster, reference):
    p, d = cluster(decode_pages=SMALL_POOL)
    requests = growing_workload(seed=2)
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, requests)
    results = router.run_until_done(180)
    assert_outputs_match(results, requests, reference)
    assert sum(r.preemptions for r in results.values()) > 0, "the small pool must force preemption"
    assert d.stats().num_preemptions > 0
    assert p.stats().pages_used == 0 and d.stats().pages_used == 0


@pytest.mark.parametrize("decode_pages", [400, SMALL_POOL])
def test_aggregated_outputs_equal_offline(model_dir, reference, decode_pages):
    kv = KVTransferConfig(store_port=free_port())
    config = DecodeConfig(num_pages=decode_pages, max_prefill_chunk=64, max_num_batched_tokens=256)
    d = WorkerProcess("decode", "d0", model_dir, config, kv, True)
    try:
        requests = workload(16, seed=3) if decode_pages > 100 else growing_workload(seed=3)
        router = MiniRouter(d, "d0")
        submit_all(router, requests)
        assert_outputs_match(router.run_until_done(180), requests, reference)
        stats = d.stats()
        assert stats.pages_used == 0
        assert (stats.num_preemptions > 0) == (decode_pages < 100)
    finally:
        d.stop()


def test_cancel_half_frees_every_page(cluster, reference):
    p, d = cluster()
    cancelled = set(list(workload(16, seed=4))[::2])
    # Cancelled requests would run long; the others finish on their own.
    requests = {
        k: (prompt, 2000 if k in cancelled else 48)
        for k, (prompt, _) in workload(16, seed=4).items()
    }
    router = MiniRouter(d, "d0", p, "p0")
    submit_all(router, requests)

    def cancel_once_started(r: MiniRouter) -> None:
        for request_id in list(cancelled - r.cancel_sent):
            if r.results[request_id].token_ids:
                r.abort(request_id)
                r.cancel_sent.add(request_id)

    router.cancel_sent = set()
    results = router.run_until_done(120, on_pump=cancel_once_started)
    for request_id, (prompt, max_tokens) in requests.items():
        if request_id in cancelled:
            assert results[request_id].finish_reason == "abort"
            assert 0 < len(results[request_id].token_ids) < max_tokens
        else:
            assert results[request_id].token_ids == reference(prompt, max_tokens)
    wait_for(lambda: p.stats().pages_used == 0, 10, "prefill pages freed")
    assert d.stats().pages_used == 0
