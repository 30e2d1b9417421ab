"""Prometheus metrics of one serving process, in vLLM's names under a `pdserve:` prefix, each labelled with the
served model's name (`model_name`, as vLLM does).

Two kinds of figure:
- per request, recorded by `RequestMetrics` as a generation's chunks pass through `RayEngineClient` (so both
  front ends count alike): prompt and generation tokens, finishes by reason, failures and admission rejections, and
  histograms of time to first token, inter-token latency (one observation per step after the first, as vLLM
  counts), end-to-end latency and router queue time (arrival to admission on a decode worker);
- per worker (label `worker`), read at scrape time from the stats the server already polls each second:
  requests running and waiting on each decode worker, KV cache usage of every worker, preemptions, MTP
  speculation's counts of each decode worker that speculates (vLLM's `spec_decode_*` counters: verifying steps,
  draft tokens, accepted tokens, accepted tokens by draft position), each worker's prefix-cache queries and
  hits in prompt tokens (vLLM's `prefix_cache_queries`, `prefix_cache_hits`), and what only P/D has: each prefill
  worker's queue (requests and prompt tokens), KV sends in flight and pages sent, and the pages (and bytes)
  not sent because the decode worker held them already, and the requests still waiting at the router for a
  decode worker. A counter series is its worker's count since start, never below what it
  showed before.

Each server has its own registry, so several servers in one process do not clash. Everything here runs on the
server's event loop (scrapes included: the HTTP front ends serve them there)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.messages import DecodeStats, PrefillStats, StageTimes
from pdserve.engine.sampling_params import FinishReason
from pdserve.model.errors import CapacityError

if TYPE_CHECKING:
    from pdserve.cluster.router import Router

PREFIX = "pdserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)

# Bucket bounds in seconds: from a fast GPU's single step up to a long request on a busy CPU test machine.
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
    20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_STEP_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


class _WorkerCollector(Collector):
    """Per-worker gauges and counters from the latest polled stats (a worker with none yet is left out)."""

    def __init__(self, model_name: str, router: Router, supervisor=None):
        """supervisor: a callable returning the server's `Supervisor` (None until it exists)."""
        self._model_name = model_name
        self._router = router
        self._supervisor = supervisor or (lambda: None)
        self._counted: dict[tuple[str, ...], float] = {}
        """Each per-worker counter series' last exposed value: a stats reply older than the last one (two
        polls in flight at once) cannot take a counter back."""

    def _families(self) -> dict[str, Metric]:
        labels = ["model_name", "worker"]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        return {
            "running": gauge(
                f"{PREFIX}num_requests_running",
                "Requests in a decode worker's running batch.",
                labels=labels,
            ),
            "waiting": gauge(
                f"{PREFIX}num_requests_waiting",
                "Requests held by a decode worker and not yet running (KV on its way, or waiting for a "
                "batch slot).",
                labels=labels,
            ),
            "kv": gauge(
                f"{PREFIX}kv_cache_usage_perc",
                "Fraction of a worker's KV cache pages in use (0 to 1).",
                labels=labels,
            ),
            "preemptions": counter(
                f"{PREFIX}num_preemptions",
                "Requests a decode worker preempted (gave their pages away) since it started.",
                labels=labels,
            ),
            "prefill_requests": gauge(
                f"{PREFIX}prefill_queue_requests",
                "Prompts on a prefill worker not yet prefilled (the one in prefill included).",
                labels=labels,
            ),
            "prefill_tokens": gauge(
                f"{PREFIX}prefill_queue_tokens",
                "Prompt tokens on a prefill worker not yet prefilled.",
                labels=labels,
            ),
            "sending": gauge(
                f"{PREFIX}kv_transfers_in_flight",
                "KV transfers a prefill worker has started and the decode side not yet acknowledged.",
                labels=labels,
            ),
            "admission": gauge(
                f"{PREFIX}num_requests_waiting_admission",
                "Requests at the router not yet admitted on any decode worker.",
                labels=["model_name"],
            ),
            "lost": counter(
                f"{PREFIX}workers_lost",
                "Workers lost (process died, heartbeats missed, a rank of the worker lost).",
                labels=["model_name"],
            ),
            "replaced": counter(
                f"{PREFIX}workers_replaced",
                "Replacements the supervisor started for lost workers.",
                labels=["model_name"],
            ),
            "migrated": counter(
                f"{PREFIX}requests_migrated",
                "Moves of requests off a lost worker (or a failed transfer) onto another worker.",
                labels=["model_name"],
            ),
            "kv_bytes": counter(
                f"{PREFIX}kv_transfer_bytes",
                "KV bytes a prefill worker sent that the decode side acknowledged.",
                labels=labels,
            ),
            "kv_pages": counter(
                f"{PREFIX}kv_transfer_pages",
                "KV pages a prefill worker sent that the decode side acknowledged.",
                labels=labels,
            ),
            "kv_pages_not_sent": counter(
                f"{PREFIX}kv_transfer_pages_not_sent",
                "KV pages a prefill worker did not send because the decode worker held them already "
                "(decode-side prefix reuse), since it started.",
                labels=labels,
            ),
            "kv_bytes_not_sent": counter(
                f"{PREFIX}kv_transfer_bytes_not_sent",
                "KV bytes a prefill worker did not send because the decode worker held those pages "
                "already, since it started.",
                labels=labels,
            ),
            "spec_drafts": counter(
                f"{PREFIX}spec_decode_num_drafts",
                "Decode steps of a request that verified MTP drafts, on a decode worker, since it started.",
                labels=labels,
            ),
            "spec_draft_tokens": counter(
                f"{PREFIX}spec_decode_num_draft_tokens",
                "MTP draft tokens a decode worker's steps verified, since it started.",
                labels=labels,
            ),
            "spec_accepted_tokens": counter(
                f"{PREFIX}spec_decode_num_accepted_tokens",
                "MTP draft tokens a decode worker accepted, since it started.",
                labels=labels,
            ),
            "spec_accepted_per_pos": counter(
                f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                "MTP draft tokens a decode worker accepted at each draft position (0: the first draft "
                "after a step's token), since it started.",
                labels=[*labels, "position"],
            ),
            "prefix_queries": counter(
                f"{PREFIX}prefix_cache_queries",
                "Prompt tokens a worker looked up in its prefix cache (each request once), since it "
                "started.",
                labels=labels,
            ),
            "prefix_hits": counter(
                f"{PREFIX}prefix_cache_hits",
                "Prompt tokens a worker found in its prefix cache, since it started.",
                labels=labels,
            ),
            "host_kv_offloaded": counter(
                f"{PREFIX}host_kv_offloaded_pages",
                "KV pages a worker stored in its host-memory tier when they left its GPU cache, since it started.",
                labels=labels,
            ),
            "host_kv_restored": counter(
                f"{PREFIX}host_kv_restored_pages",
                "KV pages a worker restored from its host-memory tier (host hits), since it started.",
                labels=labels,
            ),
            "host_kv_dropped": counter(
                f"{PREFIX}host_kv_dropped_pages",
                "KV pages a worker's GPU cache evicted that its host-memory tier had no slot for, since it "
                "started.",
                labels=labels,
            ),
            "host_kv_bytes": counter(
                f"{PREFIX}host_kv_bytes_copied",
                "Bytes a worker copied between its GPU cache and its host-memory tier, either way, since it "
                "started.",
                labels=labels,
            ),
            "kv_failures": counter(
                f"{PREFIX}kv_transfer_failures",
                "KV sends of a prefill worker that failed (the request moved or failed).",
                labels=labels,
            ),
            "expert_rebalances": counter(
                f"{PREFIX}expert_rebalances",
                "Placements of hot experts' copies in a worker's spare expert slots, since it started.",
                labels=labels,
            ),
            "expert_slots_moved": counter(
                f"{PREFIX}expert_slots_moved",
                "Spare expert slots of a worker whose expert changed (copies moved in), since it started.",
                labels=labels,
            ),
            "expert_balancedness": gauge(
                f"{PREFIX}expert_load_balancedness",
                "A worker's routed expert rows in the window before its last placement: the mean rank's "
                "over the busiest rank's (1: even), averaged over its MoE layers.",
                labels=labels,
            ),
        }

    def describe(self) -> Iterator[Metric]:
        return iter(self._families().values())

    def collect(self) -> Iterator[Metric]:
        f = self._families()
        router = self._router
        counted: dict[tuple[str, ...], float] = {}

        def count(family: str, labels: list[str], since_start: float) -> None:
            """A worker's counter: its count since start, never below what was exposed before."""
            key = (family, *labels)
            counted[key] = max(since_start, self._counted.get(key, 0))
            f[family].add_metric(labels, counted[key])

        for w in sorted(router.workers.values(), key=lambda w: w.worker_id):
            stats, labels = w.stats, [self._model_name, w.worker_id]
            if stats is None:
                continue
            if stats.pages_total:
                f["kv"].add_metric(labels, stats.pages_used / stats.pages_total)
            count("prefix_queries", labels, stats.prefix_cache_queries)
            count("prefix_hits", labels, stats.prefix_cache_hits)
            count("host_kv_offloaded", labels, stats.host_kv_offloaded_pages)
            count("host_kv_restored", labels, stats.host_kv_restored_pages)
            count("host_kv_dropped", labels, stats.host_kv_dropped_pages)
            count("host_kv_bytes", labels, stats.host_kv_bytes_copied)
            if stats.expert_rebalances:  # a worker with spare expert slots, once it placed copies
                count("expert_rebalances", labels, stats.expert_rebalances)
                count("expert_slots_moved", labels, stats.expert_slots_moved)
                f["expert_balancedness"].add_metric(labels, stats.expert_balancedness)
            if isinstance(stats, DecodeStats):
                f["running"].add_metric(labels, stats.num_running)
                f["waiting"].add_metric(labels, stats.num_waiting)
                count("preemptions", labels, stats.num_preemptions)
                if stats.spec is not None:  # a worker that speculates
                    count("spec_drafts", labels, stats.spec.steps)
                    count("spec_draft_tokens", labels, stats.spec.drafted)
                    count("spec_accepted_tokens", labels, stats.spec.accepted)
                    for position, n in enumerate(stats.spec_accepted_per_position):
                        count("spec_accepted_per_pos", [*labels, str(position)], n)
            elif isinstance(stats, PrefillStats):
                f["prefill_requests"].add_metric(labels, stats.num_queued)
                f["prefill_tokens"].add_metric(labels, stats.queued_tokens)
                f["sending"].add_metric(labels, stats.num_sending)
                count("kv_bytes", labels, stats.kv_bytes_sent)
                count("kv_pages", labels, stats.kv_pages_sent)
                count("kv_pages_not_sent", labels, stats.kv_pages_not_sent)
                count("kv_bytes_not_sent", labels, stats.kv_bytes_not_sent)
                count("kv_failures", labels, stats.num_send_failures)
        self._counted = counted  # a worker gone is forgotten with its series
        waiting = sum(
            r.admitted_at is None and r.finish_reason is None for r in router.requests.values()
        )
        f["admission"].add_metric([self._model_name], waiting)
        supervisor = self._supervisor()
        f["lost"].add_metric([self._model_name], 0 if supervisor is None else supervisor.num_lost)
        f["replaced"].add_metric(
            [self._model_name], 0 if supervisor is None else supervisor.num_replaced
        )
        f["migrated"].add_metric([self._model_name], router.num_migrated)
        return iter(f.values())


class Metrics:
    """The process's metrics registry; `RequestMetrics` records into it, `exposition` renders it. The series
    of this server's model are bound once here (a label lookup per token would cost more than the count)."""

    def __init__(self, model_name: str, router: Router, supervisor=None):
        """supervisor: a callable returning the server's `Supervisor` (None until it exists)."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        model = ["model_name"]

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, [*model, *labels], registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            family = Histogram(
                f"{PREFIX}{name}", doc, model, buckets=buckets, registry=self.registry
            )
            return family.labels(model_name)

        # Every series a dashboard reads exists from the start (at 0), not only after its first event.
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that got a first token."
        ).labels(model_name)
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated and relayed."
        ).labels(model_name)
        self.admission_rejections = counter(
            "admission_rejections",
            "Requests refused because no decode worker had room in time or the admission queue was full.",
        ).labels(model_name)
        request_success = counter(
            "request_success",
            "Requests finished, by finish reason (stop, length; abort: the client left or the server "
            "shut down).",
            "finished_reason",
        )
        self.request_success = {r: request_success.labels(model_name, r) for r in FINISH_REASONS}
        self.request_failures = counter(
            "request_failures", "Requests that ended with an error, by its type.", "error"
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Arrival at the router to the first token.",
            _LATENCY_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive steps with tokens.",
            _STEP_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Arrival at the router to the last token, of finished requests.",
            _LATENCY_BUCKETS_S,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival at the router to admission on a decode worker, of finished requests.",
            _LATENCY_BUCKETS_S,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "A finished request's first prefill chunk to its first token, on the worker that prefilled it.",
            _LATENCY_BUCKETS_S,
        )
        self.kv_transfer_time = histogram(
            "kv_transfer_seconds",
            "A finished request's first token to the decode worker's acknowledgement of its KV "
            "(disaggregated requests).",
            _STEP_BUCKETS_S,
        )
        self.request_migration_time = histogram(
            "request_migration_seconds",
            "A request's move off a lost worker to its next token.",
            _LATENCY_BUCKETS_S,
        )
        router.on_resumed = self.request_migration_time.observe
        self.registry.register(_WorkerCollector(model_name, router, supervisor))

    def exposition(self) -> bytes:
        """The text exposition format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class RequestMetrics:
    """Records one request's figures as its chunks pass; every method is called at most once per event."""

    def __init__(self, metrics: Metrics):
        self._m = metrics
        self._last_step_at: float | None = None
        self._ended = False

    def step(self, num_tokens: int, num_prompt_tokens: int, now: float, first_token_at: float | None,
             arrival: float) -> None:  # fmt: skip
        """A chunk with `num_tokens` tokens arrived at `now` (monotonic seconds)."""
        if not num_tokens:
            return
        m = self._m
        if self._last_step_at is None:
            m.prompt_tokens.inc(num_prompt_tokens)
            m.time_to_first_token.observe((first_token_at or now) - arrival)
        else:
            m.inter_token_latency.observe(now - self._last_step_at)
        self._last_step_at = now
        m.generation_tokens.inc(num_tokens)

    def finished(
        self, finish_reason: str, queued_s: float, total_s: float, stages: StageTimes | None = None
    ) -> None:
        """stages: the workers' stage times (`StageTimes`); a stage no worker reported is not observed."""
        self._ended = True
        m = self._m
        m.request_success[finish_reason].inc()
        m.e2e_request_latency.observe(total_s)
        m.request_queue_time.observe(queued_s)
        if stages is not None and stages.prefill_s:
            m.request_prefill_time.observe(stages.prefill_s)
        if stages is not None and stages.kv_transfer_s:
            m.kv_transfer_time.observe(stages.kv_transfer_s)

    def failed(self, error: BaseException) -> None:
        self._ended = True
        m = self._m
        m.request_failures.labels(m.model_name, type(error).__name__).inc()
        if isinstance(error, CapacityError):
            m.admission_rejections.inc()

    def closed(self, finish_reason: str) -> None:
        """The request was closed: unless it had ended, it counts as finished with `finish_reason` (abort)."""
        if not self._ended:
            self._ended = True
            self._m.request_success[finish_reason].inc()
