"""The one interface the front ends (the gRPC servicers, the OpenAI-compatible HTTP server) use to reach the
serving process: submit a request and stream its chunks, cancel it, read health and status, and (admin) scale and
drain. Front ends are peers over it: neither touches the router, the scaler or the server object, and each maps
chunks and errors to its own wire format (`errors.status_for`, `errors.http_error_for`).

Everything here runs on the server's event loop. A `Generation` must be closed (`cancel`, or `async with`): a
generation closed before its last chunk is aborted on every worker it touched, so its KV pages are freed."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

from pdserve.cluster.errors import UnavailableError
from pdserve.cluster.pools import DECODE, PREFILL, ROLES, WorkerState
from pdserve.cluster.request import Request
from pdserve.cluster.router import Router
from pdserve.engine.messages import DecodeStats, PrefillStats, StageTimes
from pdserve.engine.sampling_params import (
    FinishReason,
    SamplingParams,
    TokenLogprobs,
    derive_seed,
)
from pdserve.frontend import metrics
from pdserve.frontend.text_stream import TextStream
from pdserve.model.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.cluster.config import RouterConfig
    from pdserve.frontend.server import PdServer
    from pdserve.frontend.validation import ModelInfo


@dataclasses.dataclass(frozen=True, slots=True)
class Timings:
    """Where a finished request's time went, in seconds since it arrived at the router (0: never reached)."""

    queued_s: float
    time_to_first_token_s: float
    total_s: float
    num_preemptions: int
    prefill_worker: str
    decode_worker: str
    stages: StageTimes = StageTimes()
    """Durations of the stages its workers ran (its last placement's; `StageTimes`), 0.0 where one did not
    run or its prefill worker's report had not come."""

    def stage_dict(self) -> dict[str, float]:
        """Its stages in order, as the HTTP usage's `stage_times` carries them: router queue, prefill queue,
        prefill, KV transfer, decode queue, first token."""
        return {
            "router_queue_s": self.queued_s,
            **dataclasses.asdict(self.stages),
            "time_to_first_token_s": self.time_to_first_token_s,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """The tokens a generation added since the previous chunk (one decode step's, or several steps' when the
    caller fell behind: `Router._coalesce`), and on the last chunk the finish reason and timings."""

    token_ids: list[int]
    text: str
    """Their text: deltas concatenate to the output's text, which ends before a stop string; empty when the
    model has no tokenizer."""
    num_prompt_tokens: int
    num_generated_tokens: int
    """Generated so far, this chunk's tokens included."""
    finish_reason: str | None = None
    """stop, length or abort (the server is shutting down) on the last chunk; None before."""
    error: str = ""
    """Why an abort happened."""
    timings: Timings | None = None
    """On the last chunk."""
    index: int = 0
    """The choice it belongs to (`Choices`; 0 for a request of one choice)."""
    logprobs: list[TokenLogprobs] | None = None
    """Where the request asked for them: one per token of `token_ids`."""


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


class Generation:
    """A submitted request: iterate it for its chunks (the last has a finish reason; iteration raises
    PdserveError subclasses on failure), and close it with `cancel` or `async with`. A stop string ends it with
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

    def __aiter__(self) -> Generation:
        return self

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
        )

    def cancel(self) -> None:
        """Ends the request (idempotent): unless it finished, it is aborted on every worker it touched."""
        if not self._closed:
            self._closed = True
            self._metrics.closed(FinishReason.ABORT)
            self._router.close(self._request)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class Choices:
    """The `n` generations of one request (choice i is `generations[i]`, each sampled with its own seed).
    Iterate it for their chunks as they come (each names its `index`; each choice ends with its own last chunk);
    a failure of any choice raises and cancels them all. Close it with `cancel` or `async with`: every choice
    not finished is aborted on its workers."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self._pending: dict[int, asyncio.Future] = {}
        self._started = False

    @property
    def request_id(self) -> str:
        """The router's id of the first choice (logs)."""
        return self.generations[0].request_id

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> Chunk:
        if len(self.generations) == 1:  # no task per chunk for the common case
            return await anext(self.generations[0])
        if not self._started:
            self._started = True
            for g in self.generations:
                self._pending[g.index] = asyncio.ensure_future(anext(g))
        while self._pending:
            done, _ = await asyncio.wait(
                self._pending.values(), return_when=asyncio.FIRST_COMPLETED
            )
            index = min(i for i, f in self._pending.items() if f in done)  # the lowest first
            future = self._pending.pop(index)
            try:
                chunk = future.result()
            except StopAsyncIteration:
                continue
            except BaseException:
                self.cancel()
                raise
            if chunk.finish_reason is None:
                self._pending[index] = asyncio.ensure_future(anext(self.generations[index]))
            return chunk
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Ends every choice (idempotent): unless finished, each is aborted on every worker it touched."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        for g in self.generations:
            g.cancel()

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as status reports it."""

    worker_id: str
    role: str
    state: str
    num_gpus: int
    node_ip: str
    num_requests: int
    kv_pages_total: int
    page_size: int
    stats: PrefillStats | DecodeStats | None


@dataclasses.dataclass(frozen=True, slots=True)
class LostWorkerInfo:
    """A lost worker and what became of it (`supervisor.LostWorker`)."""

    worker_id: str
    role: str
    reason: str
    lost_s_ago: float
    replaced_by: str
    """Its replacement once that serves; empty before, or when none will come."""
    not_replaced: str
    """Why no replacement will come, if none will."""
    replacement_error: str
    num_requests_migrated: int


@dataclasses.dataclass(frozen=True, slots=True)
class ServerStatus:
    model: str
    workers: dict[str, list[WorkerInfo]]
    """Per role (prefill, decode), sorted by worker id."""
    num_requests: int
    output_tokens_per_s: float
    uptime_s: float
    aggregated: bool
    kv_cache_dtype: str
    lost_workers: list[LostWorkerInfo] = dataclasses.field(default_factory=list)
    """Oldest first (the latest few hundred)."""
    num_workers_lost: int = 0
    num_workers_replaced: int = 0
    num_requests_migrated: int = 0
    restarts_stopped: str = ""
    """Why lost workers are no longer replaced (the restart bound), or empty."""


class EngineClient:
    """What a front end may do with the serving process (see the module docstring)."""

    def __init__(self, server: PdServer):
        self._server = server
        self.metrics = metrics.Metrics(
            server.model.name, server.router, lambda: getattr(server, "supervisor", None)
        )
        """This server's metrics (its own registry)."""

    @property
    def model(self) -> ModelInfo:
        """The served model's name, vocabulary, context length, defaults and tokenizer."""
        return self._server.model

    @property
    def limits(self) -> RouterConfig:
        """The router's request limits and defaults (max_tokens, queue, prompt size)."""
        return self._server.config.router

    @property
    def ready(self) -> bool:
        """Whether requests are taken now: every worker warm, not shutting down."""
        return self._server.serving

    @property
    def healthy(self) -> bool:
        """What health checks report: `ready`, and a decode worker serving (as grpc.health.v1 says)."""
        return self.ready and bool(self._server.router.pool(DECODE, WorkerState.SERVING))

    def check_ready(self) -> None:
        """Raises UnavailableError unless `ready`."""
        if not self.ready:
            raise UnavailableError("the workers are not serving yet (or shutting down)")

    def submit(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams, deadline: float | None,
        stop: tuple[str, ...] = (),
    ) -> Generation:  # fmt: skip
        """Registers a checked request (`validation.check_stop_strings` for `stop`); its placement and prefill
        start when it is first iterated. `deadline` is the loop's time() by which it must finish, or None.
        `client_id` is only echoed."""
        self.check_ready()
        return self._submit(client_id, prompt_ids, params, deadline, stop, 0)

    def _submit(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams, deadline: float | None,
        stop: tuple[str, ...], index: int,
    ) -> Generation:  # fmt: skip
        router = self._server.router
        tokenizer = self.model.tokenizer
        text = None
        if tokenizer is not None:
            text = TextStream(tokenizer, prompt_ids, stop, params.skip_special_tokens)
        request = router.open(client_id, prompt_ids, params, deadline)
        return Generation(router, request, text, metrics.RequestMetrics(self.metrics), index)

    def submit_choices(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams, deadline: float | None,
        stop: tuple[str, ...] = (), n: int = 1,
    ) -> Choices:  # fmt: skip
        """`submit` for `n` choices (checked: `validation.check_n`): n requests on the workers, choice i
        seeded `derive_seed(params.seed, i)`, so a seeded request gives the same choices every time."""
        self.check_ready()
        seed = params.with_seed().seed
        return Choices([
            self._submit(
                client_id, prompt_ids, dataclasses.replace(params, seed=derive_seed(seed, i)),
                deadline, stop, i,
            )
            for i in range(n)
        ])  # fmt: skip

    def metrics_exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return self.metrics.exposition(), metrics.CONTENT_TYPE

    async def status(self) -> ServerStatus:
        """Fresh stats of every worker (bounded wait) and the router's counters."""
        server = self._server
        await server.refresh_stats()
        router, supervisor, now = server.router, server.supervisor, time.monotonic()
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
            model=str(server.model_dir),
            workers=workers,
            num_requests=len(router.requests),
            output_tokens_per_s=server.output_tokens_per_s,
            uptime_s=server.uptime_s,
            aggregated=not router.pool(PREFILL),
            kv_cache_dtype=server.config.model.kv_cache_dtype,
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
        )

    async def scale(self, role: str, count: int) -> tuple[list[str], list[str]]:
        """Grows or shrinks a pool to `count` workers; returns the ids added and removed."""
        added, removed = await self._server.scaler.scale(role, count)
        return added, removed

    async def drain(self, worker_id: str) -> int:
        """Stops one worker after its requests finish; returns how many it finished."""
        return await self._server.scaler.drain(worker_id)
