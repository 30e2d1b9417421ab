"""The router's request flow, on one asyncio loop: admission on a decode worker (D), dispatch to a prefill worker
(P), relay of D's per-step outputs, resubmission after preemption, and cleanup on cancel, deadline or failure.

For each request: reserve pages on a D (tried in order of most free pages, then fewest requests; requests wait
in FIFO order while none has room, up to admission_timeout_s), submit the prompt to the P with the fewest queued
prompt tokens together with D's transfer id (no P: D prefills itself), then relay D's outputs as they come (what P
knows of a request beyond its KV, its first token's log-probabilities and its stage times, reaches D with the KV
and comes in D's first output: nothing waits for P). One long-poll per worker brings back D's output
batches and P's failures, and the workers' prefix-cache events (`prefix_routing`); each answer is also the
worker's heartbeat (`Supervisor.check_heartbeats`). A
request that ends any other way than finishing (client cancel, deadline, failure) is aborted on every worker it
touched, after its calls in flight have landed, so its pages are freed on both sides.

Inside the system a request is keyed by an id this router makes, unique per submission (`Request.request_id`);
the client's own `request_id` is only echoed back (`Request.client_id`). So a client that cancels and at once
resends under the same id gets a new, independent request: the old one's cleanup can only touch the old one.

A lost worker (its actor died, it stopped answering, or its rank group failed) does not end its requests: each
migrates (`_migrate`). Its other worker aborts it, it takes a new internal id (so nothing the old submission still
sends can reach the new one) and is placed again like a preempted request: prompt plus the tokens already sent,
recomputed through prefill, with sampling drawn by (seed, step), so the stream goes on from the next token exactly
as it would have. With no decode worker serving it waits, within its deadline, for the replacement the supervisor
starts; with no prefill worker serving the decode worker prefills it (in batch-invariant mode it always does, replaying
the tokens already sent: `replay_on_decode`). `router.migration_limit` caps the moves.

Placement and admission (which workers, when there is room) are the router's `admission`'s (`Admission`, in
`admission.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import ray

from pdserve.cluster.admission import Admission
from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import (
    DeadlineExceededError,
    UnavailableError,
    WorkerFailedError,
    WorkerLostError,
)
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.request import Request
from pdserve.engine import messages
from pdserve.engine.messages import (
    RANK_GROUP_FAILED,
    DecodePoll,
    PrefillFailure,
    PrefillPoll,
    RequestOutput,
    SpecCounts,
    StageTimes,
)
from pdserve.engine.sampling_params import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

_CLEANUP_WAIT_S = 10.0
_IDLE_CHECK_S = 0.02


@dataclasses.dataclass(frozen=True, slots=True)
class _Lost:
    """The worker that held submission `request_id` of a request was lost."""

    request_id: str
    worker: WorkerHandle
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Shutdown:
    """The server is stopping: the request ends with finish_reason abort."""


def _joined(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one."""
    logprobs = None if a.logprobs is None else [*a.logprobs, *(b.logprobs or [])]
    stages = b.stages if a.stages is None else a.stages.merged(b.stages)
    return RequestOutput(
        a.request_id, [*a.token_ids, *b.token_ids], b.finish_reason, b.error, logprobs=logprobs,
        stages=stages, spec=SpecCounts.total((a.spec, b.spec)),
        num_cached_tokens=b.num_cached_tokens if a.num_cached_tokens is None else a.num_cached_tokens,
        prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
    )  # fmt: skip


class Router:
    def __init__(self, config: RouterConfig, replay_on_decode: bool = False):
        """replay_on_decode: batch-invariant mode (`Admission.replay_on_decode`)."""
        self.config = config
        self.workers: dict[str, WorkerHandle] = {}
        self.requests: dict[str, Request] = {}
        self.num_output_tokens = 0
        """Generated tokens relayed since start."""
        self.on_workers_changed: Callable[[], None] = lambda: None
        self.on_worker_lost: Callable[[WorkerHandle, str, str], None] = lambda *_: None
        """Called with a lost worker, why, and the state it was in (the supervisor replaces it)."""
        self.num_migrated = 0
        """Moves of requests off lost workers since start."""
        self.on_resumed: Callable[[float], None] = lambda _: None
        """Called with the seconds from a request's move to its next token (the migration time metric)."""
        self.admission = Admission(config, self.pool, self.worker_lost, replay_on_decode)
        """Where requests run and when there is room for them."""
        self._background: set[asyncio.Task] = set()
        self._closed = False
        self._ids = itertools.count()

    # Pools.

    def pool(self, role: str, *states: str) -> list[WorkerHandle]:
        states = states or (WorkerState.STARTING, WorkerState.SERVING, WorkerState.DRAINING)
        return [w for w in self.workers.values() if w.role == role and w.state in states]

    def add_worker(self, w: WorkerHandle) -> None:
        """Starts relaying the worker's outputs (or failures); it gets requests once SERVING."""
        self.workers[w.worker_id] = w
        poll = self._poll_decode if w.role == DECODE else self._poll_prefill
        w.poller = asyncio.create_task(poll(w), name=f"poll-{w.worker_id}")

    def remove_worker(self, w: WorkerHandle) -> None:
        self.workers.pop(w.worker_id, None)
        if w.poller is not None:
            w.poller.cancel()
        self.on_workers_changed()

    def worker_lost(self, w: WorkerHandle, reason: str) -> None:
        """A worker died, hangs or lost a rank: its requests migrate (`_migrate`), and the supervisor is told.
        Idempotent."""
        if w.state == WorkerState.DEAD:
            return
        logger.error("%s worker %s lost: %s", w.role, w.worker_id, reason)
        state, w.state = w.state, WorkerState.DEAD
        if w.role == DECODE:  # sends to it fail at once and free their pages; no answer is awaited
            for p in self.pool(PREFILL):
                p.actor.peer_lost.remote(w.worker_id)
        self.fail_requests(w, f"{w.role} worker {w.worker_id} was lost: {reason}")
        self.remove_worker(w)
        self.on_worker_lost(w, reason, state)

    def fail_requests(self, w: WorkerHandle, reason: str) -> None:
        """Ends each of the worker's requests' stay on it: they migrate (within router.migration_limit)."""
        for request_id in list(w.requests):
            if (r := self.requests.get(request_id)) is not None:
                r.events.put_nowait(_Lost(request_id, w, reason))

    # Requests.

    def open(
        self, client_id: str, prompt_ids: list[int], params: SamplingParams,
        deadline: float | None,
    ) -> Request:  # fmt: skip
        """Registers a request under a new internal id; the caller streams it with `next_tokens` and must
        `close` it. `client_id` is only echoed: several requests in flight may share it."""
        if self._closed:
            raise UnavailableError("the server is shutting down")
        r = Request(f"req-{next(self._ids)}", client_id, prompt_ids, params, deadline)
        self.requests[r.request_id] = r
        return r

    async def next_tokens(
        self, r: Request, force: tuple[WorkerHandle | None, WorkerHandle] | None = None
    ) -> RequestOutput | None:
        """The request's next output with tokens (or its finish), None once finished. `force` pins the
        (P, D) pair (warm-up of new workers). Raises PdserveError subclasses on failure."""
        if r.finish_reason is not None:
            return None
        if r.decode is None:
            await self.admission.place(r, force)
        while True:
            event = await self._next_event(r)
            if getattr(event, "request_id", r.request_id) != r.request_id:
                continue  # from a submission that migrated away
            if isinstance(event, _Shutdown):
                r.finish_reason, r.finished_at = FinishReason.ABORT, time.monotonic()
                self.admission.detach(r)
                return RequestOutput(
                    r.request_id, [], FinishReason.ABORT, "the server is shutting down"
                )
            if isinstance(event, _Lost):
                if force is not None:  # a warm-up: the new worker failed it
                    raise WorkerLostError(event.reason)
                await self._migrate(r, event.reason, event.worker)
                continue
            if isinstance(event, PrefillFailure):
                await self._failed(r, r.prefill, event.error, force)
                continue
            # An output that ends a stay on the decode worker (preempted, aborted there, finished) brings
            # the stay's speculation counts.
            if event.preempted:
                r.spec = SpecCounts.total((r.spec, event.spec))
                r.stages = StageTimes()
                r.num_preemptions += 1
                self.admission.detach(r)
                self._new_submission(r)
                await self.admission.place(r, force)
                continue
            if event.finish_reason == FinishReason.ABORT:
                r.spec = SpecCounts.total((r.spec, event.spec))
                error = f"{r.decode_worker}: {event.error or 'request aborted'}"
                await self._failed(r, r.decode, error, force)
                continue
            if event.finish_reason is None and not r.events.empty():
                event = self._coalesce(r, event)
            r.spec = SpecCounts.total((r.spec, event.spec))
            self.admission.prefill_done(r)
            now = time.monotonic()
            if event.token_ids and r.first_token_at is None:
                r.first_token_at = now
            if event.token_ids and r.moved_at is not None:
                logger.info(
                    "%s resumed on %s %.2fs after it moved", r.request_id, r.decode_worker,
                    now - r.moved_at,
                )  # fmt: skip
                self.on_resumed(now - r.moved_at)
                r.moved_at = None
            r.generated.extend(event.token_ids)
            r.stages = r.stages.merged(event.stages)
            if r.num_cached_tokens is None:
                r.num_cached_tokens = event.num_cached_tokens
            if event.finish_reason is not None:
                r.finish_reason, r.finished_at = event.finish_reason, now
                self.admission.detach(r)
            if event.token_ids or event.finish_reason is not None:
                return event

    @staticmethod
    def _coalesce(r: Request, event: RequestOutput) -> RequestOutput:
        """`event` with the outputs queued behind it merged in: a caller that fell behind the decode steps gets
        their tokens in one chunk rather than a backlog of chunks. Stops before any other kind of event (a
        preemption, an abort, a failure), which `r.pending` keeps for the next call."""
        while event.finish_reason is None and not r.events.empty():
            more = r.events.get_nowait()
            if getattr(more, "request_id", r.request_id) != r.request_id:
                continue  # from a submission that migrated away
            if (
                not isinstance(more, RequestOutput)
                or more.preempted
                or more.finish_reason == FinishReason.ABORT
            ):
                r.pending = more
                break
            event = _joined(event, more)
        return event

    def close(self, r: Request) -> None:
        """Forgets the request; unless it finished, aborts it on every worker it touched (in the background)."""
        self.requests.pop(r.request_id, None)
        self.admission.detach(r)
        if r.finish_reason is None and (r.touched or r.calls):
            self.spawn(self._abort_everywhere(r))

    async def _failed(
        self, r: Request, worker: WorkerHandle | None, error: str, force
    ) -> None:  # fmt: skip
        """A worker failed the request. A lost rank makes the worker lost (the request's _Lost follows); a
        failed forward pass raises (INTERNAL); anything else (a KV transfer whose peer died, a timeout) is
        retryable, and the request migrates."""
        if RANK_GROUP_FAILED in error and worker is not None:
            self.worker_lost(worker, error)
            return
        failure = WorkerFailedError(error)
        if force is not None or failure.internal:
            raise failure
        await self._migrate(r, error, None)

    async def _migrate(self, r: Request, reason: str, lost: WorkerHandle | None) -> None:
        """Moves the request off a lost worker (or after a retryable failure, `lost` None): aborts it where it
        still is (freeing its pages there), gives it a new internal id and places it again with the tokens
        already sent. Raises WorkerLostError naming the worker past router.migration_limit, UnavailableError
        when no decode worker serves or is coming."""
        if r.num_migrations >= self.config.migration_limit:
            raise WorkerLostError(
                f"{reason} (the request had moved {r.num_migrations} times already: "
                f"router.migration_limit={self.config.migration_limit})"
            )
        r.num_migrations += 1
        r.moved_at = time.monotonic()
        r.stages = StageTimes()
        self.num_migrated += 1
        if lost is not None:
            lost.num_migrated += 1
        logger.warning(
            "%s moves after %d tokens (move %d): %s", r.request_id, len(r.generated),
            r.num_migrations, reason,
        )  # fmt: skip
        others = {w for w in (r.prefill, r.decode) if w is not None}
        self.admission.detach(r)
        if r.calls:  # an add_request or submit still under way lands first, so the abort finds it
            await asyncio.wait(list(r.calls), timeout=_CLEANUP_WAIT_S)
        aborts = [w.actor.abort.remote(r.request_id) for w in others if w.state != WorkerState.DEAD]
        await self._await_aborts(r, aborts)
        self._new_submission(r)
        self.admission.room_freed()
        await self.admission.place(r, None)

    def _new_submission(self, r: Request) -> None:
        """Gives `r`, moved or preempted, a new internal id for its next placement: nothing its last
        submission still holds or sends reaches the new one (a prefill worker still holds a preempted
        request until its send's acknowledgement is back, and would refuse the same id again)."""
        self.requests.pop(r.request_id, None)
        base = r.request_id.split(".")[0]
        r.request_id = f"{base}.{r.num_migrations + r.num_preemptions}"
        self.requests[r.request_id] = r
        r.touched = set()

    async def _abort_everywhere(self, r: Request) -> None:
        if r.calls:  # an add_request or submit still under way lands first, so the abort finds it
            await asyncio.wait(list(r.calls), timeout=_CLEANUP_WAIT_S)
        aborts = [
            w.actor.abort.remote(r.request_id) for w in r.touched if w.state != WorkerState.DEAD
        ]
        await self._await_aborts(r, aborts)
        self.admission.room_freed()

    @property
    def closed(self) -> bool:
        """True from the start of a shutdown: no new request is taken."""
        return self._closed

    @staticmethod
    async def _await_aborts(r: Request, aborts: list) -> None:
        for result in await asyncio.gather(*aborts, return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("abort of %s failed: %s", r.request_id, result)

    async def _next_event(self, r: Request):
        if r.pending is not None:
            event, r.pending = r.pending, None
            return event
        timeout = None if r.deadline is None else r.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(r.events.get(), timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"deadline exceeded after {len(r.generated)} of {r.params.max_tokens} tokens"
            ) from None

    # Relaying.

    async def _poll_decode(self, w: WorkerHandle) -> None:
        while not self._closed:
            try:
                data = await w.actor.poll_outputs.remote(self.config.poll_timeout_s)
            except ray.exceptions.RayError as e:
                self.worker_lost(w, str(e).splitlines()[0])
                return
            w.last_heartbeat = time.monotonic()
            poll = messages.decode(DecodePoll, data)
            if poll.cache_events is not None and w.prefix is not None:
                w.prefix.apply(poll.cache_events)
            for out in poll.outputs:
                self.num_output_tokens += len(out.token_ids)
                r = self.requests.get(out.request_id)
                # also while its reservation's answer is on its way (r.decode still None): a decode
                # worker that prefills the request itself may stream from it before that answer lands
                if r is not None and (r.decode is w or (r.decode is None and w in r.touched)):
                    r.events.put_nowait(out)
                if out.finish_reason is not None or out.preempted:
                    self.admission.room_freed()

    async def _poll_prefill(self, w: WorkerHandle) -> None:
        while not self._closed:
            try:
                data = await w.actor.poll_failures.remote(self.config.poll_timeout_s)
            except ray.exceptions.RayError as e:
                self.worker_lost(w, str(e).splitlines()[0])
                return
            w.last_heartbeat = time.monotonic()
            poll = messages.decode(PrefillPoll, data)
            if poll.cache_events is not None and w.prefix is not None:
                w.prefix.apply(poll.cache_events)
            for failure in poll.failures:
                r = self.requests.get(failure.request_id)
                if r is not None and r.prefill is w:
                    r.events.put_nowait(failure)

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_idle(self, timeout_s: float) -> None:
        """Waits until no request is open, or `timeout_s` passed."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        while self.requests and loop.time() < give_up:
            await asyncio.sleep(_IDLE_CHECK_S)

    async def close_all(self) -> None:
        """Refuses new requests and ends the open ones: each gets a last output with finish_reason abort
        (its caller streams it), then relaying stops."""
        self._closed = True
        for r in list(self.requests.values()):
            r.events.put_nowait(_Shutdown())
        await self.wait_idle(_CLEANUP_WAIT_S)
        for w in list(self.workers.values()):
            if w.poller is not None:
                w.poller.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=_CLEANUP_WAIT_S)
