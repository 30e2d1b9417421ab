"""The one interface the front ends (the gRPC servicers, the OpenAI-compatible HTTP server) use to reach the
serving process (`EngineClient`, an abstract base class), and what crosses it: submit a request and stream its
chunks (`Choices`, a `ChunkStream`), cancel it, read health, status and the model's facts, and (admin) scale and
drain. Front ends are peers over it: neither touches the router, the scaler or the server object, and each maps
chunks and errors to its own wire format (`errors.status_for`, `errors.http_error_for`). The serving process's
implementation is `ray_engine.RayEngineClient`.

Everything here runs on the server's event loop. A stream must be closed (`cancel`, or `async with`): one closed
before its last chunk is aborted on every worker it touched, so its KV pages are freed."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from typing import TYPE_CHECKING

from pdserve.cluster.errors import UnavailableError
from pdserve.engine.messages import DecodeStats, PrefillStats, SpecCounts, StageTimes
from pdserve.engine.sampling_params import TokenLogprobs

if TYPE_CHECKING:
    from pdserve.cluster.config import RouterConfig
    from pdserve.frontend.request_builder import CheckedRequest
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
    spec: SpecCounts | None = None
    """On the last chunk, where decode steps of the request verified drafts (MTP speculation): the drafts
    verified and accepted and the verifying steps, summed over the decode workers it ran on (a worker lost
    under it, or a stop string that ended it before its decode worker did, leaves that stay's out)."""
    num_cached_tokens: int = 0
    """Of its prompt tokens, those its prefill found in a prefix cache (0 while not reported)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On its first chunk, where the request asked for them (`SamplingParams.prompt_logprobs`): per prompt
    token after the first, its log-probability and alternatives."""


class ChunkStream(abc.ABC):
    """A submitted request's output: iterate it for its chunks (each choice's last chunk has a finish reason;
    iteration raises PdserveError subclasses on failure), and close it with `cancel` or `async with`. Closed
    before its last chunk, it is aborted on every worker it touched, so its KV pages are freed."""

    @property
    @abc.abstractmethod
    def request_id(self) -> str:
        """The serving process's id for this request (logs, workers); never the client's."""

    def __aiter__(self) -> ChunkStream:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> Chunk: ...

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ends the request (idempotent): unless it finished, it is aborted on every worker it touched."""

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class Choices(ChunkStream):
    """The `n` choices of one request (choice i is `generations[i]`, each sampled with its own seed).
    Iterate it for their chunks as they come (each names its `index`; each choice ends with its own last chunk);
    a failure of any choice raises and cancels them all. Close it with `cancel` or `async with`: every choice
    not finished is aborted on its workers."""

    def __init__(self, generations: list[ChunkStream]):
        """generations: choice i at position i (its chunks have index i)."""
        self.generations = generations
        self._pending: dict[int, asyncio.Future] = {}
        self._started = False

    @property
    def request_id(self) -> str:
        """The serving process's id of the first choice (logs)."""
        return self.generations[0].request_id

    async def __anext__(self) -> Chunk:
        if len(self.generations) == 1:  # no task per chunk for the common case
            return await anext(self.generations[0])
        if not self._started:
            self._started = True
            for i, g in enumerate(self.generations):
                self._pending[i] = asyncio.ensure_future(anext(g))
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
class EndpointInfo:
    """One address the serving process listens on."""

    name: str
    """gRPC, HTTP, metrics, KV store or Ray (the cluster's GCS)."""
    address: str
    """host:port."""
    auth: str
    """What a caller must present, in words ("API key", "Ray token", "none ...")."""
    tls: str
    """none, TLS or mutual TLS."""


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
    endpoints: list[EndpointInfo] = dataclasses.field(default_factory=list)
    """What the serving process listens on."""


class EngineClient(abc.ABC):
    """What a front end may do with the serving process (see the module docstring). Every method runs on the
    server's event loop."""

    @property
    @abc.abstractmethod
    def model(self) -> ModelInfo:
        """The served model's name, vocabulary, context length, defaults and tokenizer."""

    @property
    @abc.abstractmethod
    def limits(self) -> RouterConfig:
        """The router's request limits and defaults (max_tokens, queue, prompt size)."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether requests are taken now: every worker warm, not shutting down."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """What health checks report: `ready`, and a decode worker serving (as grpc.health.v1 says)."""

    def check_ready(self) -> None:
        """Raises UnavailableError unless `ready`."""
        if not self.ready:
            raise UnavailableError("the workers are not serving yet (or shutting down)")

    @abc.abstractmethod
    def submit(self, request: CheckedRequest) -> Choices:
        """Registers a request (`request_builder.build_request` checked it) as its `n` choices, choice i
        seeded `derive_seed(params.seed, i)`, so that a seeded request gives the same choices every time; their
        placement and prefill start when it is first iterated. Its `client_id` is only echoed. Raises
        UnavailableError unless `ready`."""

    @abc.abstractmethod
    def metrics_exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""

    @abc.abstractmethod
    async def status(self) -> ServerStatus:
        """Fresh stats of every worker (bounded wait) and the serving process's counters."""

    @abc.abstractmethod
    async def scale(self, role: str, count: int) -> tuple[list[str], list[str]]:
        """Grows or shrinks a pool to `count` workers; returns the ids added and removed."""

    @abc.abstractmethod
    async def drain(self, worker_id: str) -> int:
        """Stops one worker after its requests finish; returns how many it finished."""
