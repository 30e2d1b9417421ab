"""The metrics registry without a cluster: what each request event records, per-worker series from the latest
stats (speculation's per decode worker; counters never going back), and two servers' registries kept apart.
(End to end through `pdserve serve`: test_openai_http.py.)"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import WorkerLostError
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle
from pdserve.cluster.router import Router
from pdserve.engine.messages import DecodeStats, PrefillStats, SpecCounts, StageTimes
from pdserve.frontend.metrics import Metrics, RequestMetrics
from pdserve.model.errors import CapacityError

MODEL = "tiny"


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_request_events_record_tokens_latencies_and_finish_reasons():
    metrics = Metrics(MODEL, Router(RouterConfig()))
    finished = RequestMetrics(metrics)
    finished.step(1, 30, now=10.5, first_token_at=10.4, arrival=10.0)
    finished.step(0, 30, now=10.6, first_token_at=10.4, arrival=10.0)  # a chunk with no tokens
    finished.step(2, 30, now=10.7, first_token_at=10.4, arrival=10.0)
    finished.step(1, 30, now=10.75, first_token_at=10.4, arrival=10.0)
    finished.finished("stop", queued_s=0.05, total_s=0.75)
    finished.closed("abort")  # closing after the last chunk counts nothing more
    left = RequestMetrics(metrics)
    left.step(1, 8, now=20.2, first_token_at=20.2, arrival=20.0)
    left.closed("abort")
    left.closed("abort")

    assert sample(metrics, "pdserve:prompt_tokens_total") == 38
    assert sample(metrics, "pdserve:generation_tokens_total") == 5
    reasons = {r: sample(metrics, "pdserve:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort")}  # fmt: skip
    assert reasons == {"stop": 1, "length": 0, "abort": 1}
    ttft = "pdserve:time_to_first_token_seconds"
    assert sample(metrics, f"{ttft}_count") == 2
    assert abs(sample(metrics, f"{ttft}_sum") - (0.4 + 0.2)) < 1e-9
    itl = "pdserve:inter_token_latency_seconds"
    assert sample(metrics, f"{itl}_count") == 2  # steps after the first, not tokens
    assert abs(sample(metrics, f"{itl}_sum") - 0.25) < 1e-9
    assert sample(metrics, f"{itl}_bucket", le="0.15") == 1  # 0.05 in, 0.2 out
    assert sample(metrics, "pdserve:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "pdserve:request_queue_time_seconds_sum") == 0.05
    # the stage times of a disaggregated request, and of one prefilled by its decode worker (no transfer)
    for stages in (StageTimes(0.01, 0.2, 0.03, 0.001), StageTimes(0.01, 0.1, 0.0, 0.001)):
        RequestMetrics(metrics).finished("length", queued_s=0.0, total_s=1.0, stages=stages)
    assert sample(metrics, "pdserve:request_prefill_time_seconds_count") == 2
    assert abs(sample(metrics, "pdserve:request_prefill_time_seconds_sum") - 0.3) < 1e-9
    assert sample(metrics, "pdserve:kv_transfer_seconds_count") == 1
    assert sample(metrics, "pdserve:kv_transfer_seconds_sum") == 0.03


def test_failures_count_by_type_and_admission_rejections_apart():
    metrics = Metrics(MODEL, Router(RouterConfig()))
    for error in (CapacityError("no room"), WorkerLostError("gone"), CapacityError("queue full")):
        r = RequestMetrics(metrics)
        r.failed(error)
        r.closed("abort")  # a failed request is not also an abort
    assert sample(metrics, "pdserve:admission_rejections_total") == 2
    assert sample(metrics, "pdserve:request_failures_total", error="CapacityError") == 2
    assert sample(metrics, "pdserve:request_failures_total", error="WorkerLostError") == 1
    assert sample(metrics, "pdserve:request_success_total", finished_reason="abort") == 0


def test_worker_series_come_from_the_latest_stats_and_registries_are_per_server():
    router = Router(RouterConfig())
    decode = WorkerHandle("decode-0", DECODE, None, None, 0)
    prefill = WorkerHandle("prefill-0", PREFILL, None, None, 0)
    starting = WorkerHandle("decode-1", DECODE, None, None, 0)  # no stats yet: no series
    for w in (decode, prefill, starting):
        router.workers[w.worker_id] = w
    metrics = Metrics(MODEL, router)
    other = Metrics(MODEL, Router(RouterConfig()))
    decode.stats = DecodeStats("decode-0", 3, 2, 48, 64, 256, 16, 7)
    prefill.stats = PrefillStats(
        "prefill-0",
        4,
        900,
        1,
        16,
        128,
        5 << 20,
        2,
        prefix_cache_queries=300,
        prefix_cache_hits=128,
        host_kv_offloaded_pages=7,
        host_kv_restored_pages=5,
        host_kv_dropped_pages=1,
        host_kv_bytes_copied=4096,
        kv_pages_sent=80,
        kv_pages_not_sent=24,
        kv_bytes_not_sent=3 << 20,
    )

    series = samples(metrics)
    workers = {dict(labels).get("worker") for _, labels in series} - {None}
    assert workers == {"decode-0", "prefill-0"}
    assert sample(metrics, "pdserve:num_requests_running", worker="decode-0") == 3
    assert sample(metrics, "pdserve:num_requests_waiting", worker="decode-0") == 2
    assert sample(metrics, "pdserve:kv_cache_usage_perc", worker="decode-0") == 0.75
    assert sample(metrics, "pdserve:kv_cache_usage_perc", worker="prefill-0") == 0.125
    assert sample(metrics, "pdserve:num_preemptions_total", worker="decode-0") == 7
    assert sample(metrics, "pdserve:prefill_queue_requests", worker="prefill-0") == 4
    assert sample(metrics, "pdserve:prefill_queue_tokens", worker="prefill-0") == 900
    assert sample(metrics, "pdserve:kv_transfers_in_flight", worker="prefill-0") == 1
    assert sample(metrics, "pdserve:kv_transfer_bytes_total", worker="prefill-0") == 5 << 20
    assert sample(metrics, "pdserve:kv_transfer_failures_total", worker="prefill-0") == 2
    assert sample(metrics, "pdserve:kv_transfer_pages_total", worker="prefill-0") == 80
    assert sample(metrics, "pdserve:kv_transfer_pages_not_sent_total", worker="prefill-0") == 24
    assert (
        sample(metrics, "pdserve:kv_transfer_bytes_not_sent_total", worker="prefill-0") == 3 << 20
    )
    assert sample(metrics, "pdserve:prefix_cache_queries_total", worker="prefill-0") == 300
    assert sample(metrics, "pdserve:prefix_cache_hits_total", worker="prefill-0") == 128
    assert sample(metrics, "pdserve:prefix_cache_hits_total", worker="decode-0") == 0
    assert sample(metrics, "pdserve:host_kv_offloaded_pages_total", worker="prefill-0") == 7
    assert sample(metrics, "pdserve:host_kv_restored_pages_total", worker="prefill-0") == 5
    assert sample(metrics, "pdserve:host_kv_dropped_pages_total", worker="prefill-0") == 1
    assert sample(metrics, "pdserve:host_kv_bytes_copied_total", worker="prefill-0") == 4096
    assert sample(metrics, "pdserve:host_kv_restored_pages_total", worker="decode-0") == 0
    router.on_resumed(0.4)  # a moved request's next token, 0.4 s after its move
    assert sample(metrics, "pdserve:request_migration_seconds_count") == 1
    assert sample(metrics, "pdserve:request_migration_seconds_sum") == 0.4
    decode.stats = DecodeStats("decode-0", 1, 0, 16, 64, 256, 16, 9)
    assert sample(metrics, "pdserve:num_requests_running", worker="decode-0") == 1
    assert sample(metrics, "pdserve:num_preemptions_total", worker="decode-0") == 9

    RequestMetrics(metrics).step(4, 10, now=1.0, first_token_at=1.0, arrival=0.5)
    assert sample(metrics, "pdserve:generation_tokens_total") == 4
    assert sample(other, "pdserve:generation_tokens_total") == 0
    assert not {dict(labels).get("worker") for _, labels in samples(other)} - {None}


def test_speculation_counters_per_decode_worker_never_go_back():
    router = Router(RouterConfig())
    speculating = WorkerHandle("decode-0", DECODE, None, None, 0)
    plain = WorkerHandle("decode-1", DECODE, None, None, 0)
    for w in (speculating, plain):
        router.workers[w.worker_id] = w
    metrics = Metrics(MODEL, router)
    plain.stats = DecodeStats("decode-1", 0, 0, 0, 64, 256, 16, 0)  # does not speculate: no series
    speculating.stats = DecodeStats(
        "decode-0", 1, 0, 8, 64, 256, 16, 0, SpecCounts(10, 6, 5), (4, 2)
    )
    prefix = "pdserve:spec_decode_num"
    assert sample(metrics, f"{prefix}_drafts_total", worker="decode-0") == 5
    assert sample(metrics, f"{prefix}_draft_tokens_total", worker="decode-0") == 10
    assert sample(metrics, f"{prefix}_accepted_tokens_total", worker="decode-0") == 6
    per_pos = f"{prefix}_accepted_tokens_per_pos_total"
    assert sample(metrics, per_pos, worker="decode-0", position="0") == 4
    assert sample(metrics, per_pos, worker="decode-0", position="1") == 2
    assert not [key for key in samples(metrics) if key[0].startswith(prefix)
                and ("worker", "decode-1") in key[1]]  # fmt: skip

    # A later poll's counts show; a reply older than the last one shown does not take them back.
    speculating.stats = DecodeStats(
        "decode-0", 1, 0, 8, 64, 256, 16, 3, SpecCounts(14, 9, 7), (6, 3)
    )
    assert sample(metrics, f"{prefix}_draft_tokens_total", worker="decode-0") == 14
    speculating.stats = DecodeStats(
        "decode-0", 1, 0, 8, 64, 256, 16, 2, SpecCounts(12, 7, 6), (5, 2)
    )
    assert sample(metrics, f"{prefix}_drafts_total", worker="decode-0") == 7
    assert sample(metrics, f"{prefix}_draft_tokens_total", worker="decode-0") == 14
    assert sample(metrics, f"{prefix}_accepted_tokens_total", worker="decode-0") == 9
    assert sample(metrics, per_pos, worker="decode-0", position="0") == 6
    assert sample(metrics, "pdserve:num_preemptions_total", worker="decode-0") == 3

    # A worker gone takes its series with it.
    del router.workers["decode-0"]
    assert not [key for key in samples(metrics) if key[0].startswith(prefix)]


def test_expert_balance_series_for_workers_that_placed_copies():
    router = Router(RouterConfig())
    balanced = WorkerHandle("decode-0", DECODE, None, None, 0)
    plain = WorkerHandle("prefill-0", PREFILL, None, None, 0)
    for w in (balanced, plain):
        router.workers[w.worker_id] = w
    metrics = Metrics(MODEL, router)
    balanced.stats = DecodeStats(
        "decode-0", 1, 0, 8, 64, 256, 16, 0,
        expert_rebalances=3, expert_slots_moved=11, expert_balancedness=0.92,
    )  # fmt: skip
    plain.stats = PrefillStats("prefill-0", 0, 0, 0, 0, 64)  # no spare slots: no series
    assert sample(metrics, "pdserve:expert_rebalances_total", worker="decode-0") == 3
    assert sample(metrics, "pdserve:expert_slots_moved_total", worker="decode-0") == 11
    assert sample(metrics, "pdserve:expert_load_balancedness", worker="decode-0") == 0.92
    assert not [
        key for key in samples(metrics)
        if key[0].startswith("pdserve:expert") and ("worker", "prefill-0") in key[1]
    ]  # fmt: skip
