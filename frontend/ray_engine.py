"""The serving process's `EngineClient`: requests go to the router (`cluster.router`) on this event loop, pools are
scaled and drained by the scaler, status comes from the workers' stats, the router and the supervisor. Each
request's figures go to this process's metrics (`metrics`) as its chunks pass, so both front ends count alike."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pdserve.cluster.pools import DECODE, PREFILL, ROLES, WorkerState
from pdserve.cluster.request import Request
from pdserve.cluster.router import Router
from pdserve.engine.sampling_params import FinishReason, SamplingParams, derive_seed
from pdserve.frontend import metrics
from pdserve.frontend.engine_client import (
    Choices,
    Chunk,
    ChunkStream,
    EndpointInfo,
    EngineClient,
    LostWorkerInfo,
    ServerStatus,
    Timings,
    WorkerInfo,
)
from pdserve.frontend.text_stream import TextStream
from pdserve.model.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.cluster.config import RouterConfig
    from pdserve.cluster.scaling import Scaler
    from pdserve.cluster.supervisor import Supervisor
    from pdserve.frontend.request_builder import CheckedRequest
    from pdserve.frontend.validation import ModelInfo


def _timings(r: Request, finished_at: float | None) -> Timings:
    def since_arrival(t: float | None) -> float:
        return 0.0 if t is None else t - r.arrival

    return Timings(
        queued_s=since_arrival(r.admitted_at),
        time_to_first_token_s=since_arrival(r.first_token_at),
        total_s=since_arrival(finished_at),
        num_preemptions=r.num_preemptions,
        prefill_worker=r.prefill_worker,
        decode_worker=r.decode_worker,
        stages=r.stages,
    )


class Generation(ChunkStream):
    """One choice of a submitted request on the router (a `ChunkStream`). A stop string ends it with
    finish reason stop, and it is then aborted on its workers (the model is not told about stop strings).
    Its figures go to `metrics` as its chunks pass; one closed before it ended counts as finished with abort."""

    def __init__(
        self, router: Router, request: Request, text: TextStream | None,
        request_metrics: metrics.RequestMetrics, index: int = 0,
    ):  # fmt: skip
        """index: which choice of its request it is (its chunks say so)."""
        self.index = index
        self._router = router
        self._request = request
        self._text = text
        self._metrics = request_metrics
        self._closed = False
        self._stopped = False

    @property
    def request_id(self) -> str:
        """The router's id for this request (logs, workers); never the client's."""
        return self._request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self._request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self._request.params

    async def __anext__(self) -> Chunk:
        r = self._request
        if self._stopped:
            raise StopAsyncIteration
        try:
            out = await self._router.next_tokens(r)
        except PdserveError as e:
            self._metrics.failed(e)
            raise
        if out is None:
            raise StopAsyncIteration
        finish_reason, finished_at = out.finish_reason, r.finished_at
        text = ""
        if self._text is not None and finish_reason != FinishReason.ABORT:
            text, stopped = self._text.push(out.token_ids)
            if not stopped and finish_reason is not None:
                more, stopped = self._text.finish()
                text += more
            if stopped:
                finish_reason, finished_at = FinishReason.STOP, time.monotonic()
                self._stopped = True
        last = finish_reason is not None
        timings = _timings(r, finished_at) if last else None
        self._metrics.step(
            len(out.token_ids), len(r.prompt_ids), time.monotonic(), r.first_token_at, r.arrival
        )
        if timings is not None:
            self._metrics.finished(finish_reason, timings.queued_s, timings.total_s, timings.stages)
        if self._stopped:
            self.cancel()
        return Chunk(
            token_ids=list(out.token_ids),
            text=text,
            num_prompt_tokens=len(r.prompt_ids),
            num_generated_tokens=len(r.generated),
            finish_reason=finish_reason,
            error=(out.error or "") if last else "",
            timings=timings,
            index=self.index,
            logprobs=None if out.logprobs is None else list(out.logprobs),
            spec=r.spec if last else None,
            num_cached_tokens=r.num_cached_tokens or 0,
            prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs),
        )

    def cancel(self) -> None:
        """Ends the request (idempotent): unless it finished, it is aborted on every worker it touched."""
        if not self._closed:
            self._closed = True
            self._metrics.closed(FinishReason.ABORT)
            self._router.close(self._request)


class RayEngineClient(EngineClient):
    """`EngineClient` over the router, the scaler and the supervisor of this serving process."""

    def __init__(
        self, router: Router, scaler: Scaler, supervisor: Supervisor, model: ModelInfo,
        limits: RouterConfig, *, model_dir: str, kv_cache_dtype: str, started_at: float,
        ready: Callable[[], bool], refresh_stats: Callable[[], Awaitable[float]],
        endpoints: Callable[[], list[EndpointInfo]] = list,
    ):  # fmt: skip
        """model_dir, kv_cache_dtype: what status reports of the deployment; started_at: time.monotonic()
        when the serving process started. ready(): whether the process takes requests now (every worker warm,
        not shutting down). refresh_stats(): fetches every worker's stats (bounded wait) and returns the
        output tokens per second since the previous refresh. endpoints(): what the process listens on."""
        self._router, self._scaler, self._supervisor = router, scaler, supervisor
        self._model, self._limits = model, limits
        self._model_dir, self._kv_cache_dtype, self._started_at = (
            model_dir,
            kv_cache_dtype,
            started_at,
        )
        self._ready, self._refresh_stats, self._endpoints = ready, refresh_stats, endpoints
        self.metrics = metrics.Metrics(model.name, router, lambda: supervisor)
        """This server's metrics (its own registry)."""

    @property
    def model(self) -> ModelInfo:
        return self._model

    @property
    def limits(self) -> RouterConfig:
        return self._limits

    @property
    def ready(self) -> bool:
        return self._ready()

    @property
    def healthy(self) -> bool:
        return self.ready and bool(self._router.pool(DECODE, WorkerState.SERVING))

    def submit(self, request: CheckedRequest) -> Choices:
        self.check_ready()
        r, seed = request, request.params.with_seed().seed
        return Choices([
            self._generation(
                r.client_id, r.prompt_ids, dataclasses.replace(r.params, seed=derive_seed(seed, i)),
                r.deadline, r.stop, i,
            )
            for i in range(r.n)
        ])  # fmt: skip

    def _generation(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams, deadline: float | None,
        stop: tuple[str, ...], index: int,
    ) -> Generation:  # fmt: skip
        tokenizer = self._model.tokenizer
        text = None
        if tokenizer is not None:
            text = TextStream(tokenizer, prompt_ids, stop, params.skip_special_tokens)
        request = self._router.open(client_id, prompt_ids, params, deadline)
        return Generation(self._router, request, text, metrics.RequestMetrics(self.metrics), index)

    def metrics_exposition(self) -> tuple[bytes, str]:
        return self.metrics.exposition(), metrics.CONTENT_TYPE

    async def status(self) -> ServerStatus:
        output_tokens_per_s = await self._refresh_stats()
        router, supervisor, now = self._router, self._supervisor, time.monotonic()
        workers = {}
        for role in ROLES:
            pool = sorted(router.pool(role), key=lambda w: w.worker_id)
            workers[role] = [
                WorkerInfo(
                    w.worker_id,
                    w.role,
                    w.state,
                    w.num_gpus,
                    w.node_ip,
                    len(w.requests),
                    w.num_pages,
                    w.page_size,
                    w.stats,
                )  # fmt: skip
                for w in pool
            ]
        return ServerStatus(
            model=self._model_dir,
            workers=workers,
            num_requests=len(router.requests),
            output_tokens_per_s=output_tokens_per_s,
            uptime_s=now - self._started_at,
            aggregated=not router.pool(PREFILL),
            kv_cache_dtype=self._kv_cache_dtype,
            lost_workers=[
                LostWorkerInfo(
                    x.worker.worker_id,
                    x.worker.role,
                    x.reason,
                    now - x.lost_at,
                    x.replaced_by,
                    x.not_replaced,
                    x.replacement_error,
                    x.worker.num_migrated,
                )  # fmt: skip
                for x in supervisor.lost
            ],
            num_workers_lost=supervisor.num_lost,
            num_workers_replaced=supervisor.num_replaced,
            num_requests_migrated=router.num_migrated,
            restarts_stopped=router.admission.restarts_stopped,
            endpoints=self._endpoints(),
        )

    async def scale(self, role: str, count: int) -> tuple[list[str], list[str]]:
        return await self._scaler.scale(role, count)

    async def drain(self, worker_id: str) -> int:
        return await self._scaler.drain(worker_id)
