"""`PrefillWorker`: computes prompts' KV caches and first tokens and hands them to decode workers: the prefill
role over the engine's scheduler (every request `Policy.PREFILL_ONLY`: a FIFO of prompts, batched under a token
budget, long prompts chunked, pages taken when a prompt starts) and the KV export.

A plain class (Ray wraps it in pdserve.cluster). Control calls (`submit`, `abort`, `stats`) may come from any
thread; `step` runs on the worker's loop thread. Finished prompts are sent by a small thread pool, one send at a
time per decode peer, each with what this worker knows of the request beyond its KV (`PrefillHandoff`: the first
token's log-probabilities, the stages it ran here); a prompt's pages are freed when its decode worker
acknowledges or the send fails. Failures are reported through `poll_failures` and fail only the requests
involved.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve import kernels
from pdserve.engine.drafter import check_speculation
from pdserve.engine.messages import (
    PackedLogprobs,
    PrefillFailure,
    PrefillHandoff,
    PrefillPoll,
    PrefillRequest,
    PrefillStats,
)
from pdserve.engine.pages import pages_needed
from pdserve.engine.ranks.group import RankGroup
from pdserve.engine.request import Policy, Request, RequestState, stage_times
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.engine.worker import (
    Worker,
    expert_balance_counts,
    host_tier_counts,
    prefix_cache_counts,
)
from pdserve.kvtransfer import KVSender
from pdserve.model.deepseek import Transformer
from pdserve.model.errors import ConfigError, InvalidRequestError, PdserveError

from .config import PrefillConfig

logger = logging.getLogger(__name__)

POLL_CHECK_S = 0.005
"""How often the router's long-poll (`poll`) looks for failures."""
CACHE_EVENTS_MIN_S = 0.05
"""A long-poll that found only cache events returns no sooner than this after it began: the events of a burst
of prompts go to the router in one answer."""


class PrefillWorker(Worker):
    def __init__(
        self, worker_id: str, model: Transformer | None, config: PrefillConfig, sender: KVSender,
        kv_cache_dtype: str = "auto", ranks: RankGroup | None = None,
        runner: ModelRunner | None = None,
    ):  # fmt: skip
        """kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`); must be the decode workers'; ranks: the
        worker's running rank group when `config.layout.ranks` > 1 (`Worker`; then `model` is unused). Rank 0 sends
        the KV pages, so several ranks need tensor-parallel attention (the same latent cache on each).
        runner: a runner to step instead of one over `model` (`Worker`)."""
        if ranks is not None and config.layout.attention != "tensor":
            raise ConfigError(
                f"prefill attention={config.layout.attention!r} with ranks={config.layout.ranks}: a prefill worker of "
                "several ranks sends its KV from rank 0, so it needs attention='tensor'"
            )
        super().__init__(worker_id, model, config, kv_cache_dtype, ranks=ranks, runner=runner)
        self.sender = sender
        args = self.model.args
        self.scheduler = self._make_scheduler(
            config.page_size, config.max_num_batched_tokens,
            config.max_prefill_chunk, args.vocab_size, args.max_position_embeddings,
            args.eos_token_ids, fixed_chunks=kernels.batch_invariant(), worker_kind="prefill worker",
            num_drafts=min(check_speculation(self.model, config.num_speculative_tokens), 1),
            prefix_caching=config.enable_prefix_caching,
        )  # fmt: skip
        self._aborted: set[str] = set()
        self._failures: list[PrefillFailure] = []
        self._kv_bytes_sent = 0
        self._kv_pages_sent = 0
        self._kv_pages_not_sent = 0
        self._num_send_failures = 0
        self._sends = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{worker_id}-send")

    def submit(self, request: PrefillRequest) -> None:
        """Queues a prompt. Raises InvalidRequestError / CapacityError when it cannot ever run here, or
        when its decode worker's held pages leave none to send."""
        num_pages = pages_needed(len(request.token_ids), self.config.page_size)
        if request.num_held_pages and not 0 < request.num_held_pages < num_pages:
            raise InvalidRequestError(
                "num_held_pages",
                f"{request.num_held_pages} for a request of {num_pages} KV pages: must be in "
                f"[0, {num_pages - 1}] (the decode worker holds at most all but the last)",
            )
        with self._lock:
            self.scheduler.add(
                Request(
                    request.request_id,
                    list(request.token_ids),
                    request.params,
                    Policy.PREFILL_ONLY,
                    request.num_generated,
                    payload=request,
                )
            )
        self.sender.connect(request.decode_peer)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drops a request. A send already under way completes (the decode side discards it) first."""
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                return
            if request.state is RequestState.SENDING:
                self._aborted.add(request_id)
            else:
                self.scheduler.abort(request_id)

    def peer_lost(self, decode_worker: str) -> None:
        """Decode worker `decode_worker` was lost: sends to it fail at once (freeing their pages) rather than
        wait for it; its requests' aborts come from the router."""
        self.sender.forget(decode_worker)

    def poll_failures(self) -> list[PrefillFailure]:
        """The requests this worker failed since the last call (everything else about a request goes to its
        decode worker, with its KV)."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def poll(self, timeout_s: float = 0.0) -> PrefillPoll:
        """The router's long-poll: waits up to `timeout_s` for a failure, or for the prefix cache's events
        (answered CACHE_EVENTS_MIN_S after the poll began at the soonest); returns them."""
        start = time.monotonic()
        while True:
            failures = self.poll_failures()
            now = time.monotonic()
            if (
                failures
                or now - start >= timeout_s
                or (now - start >= CACHE_EVENTS_MIN_S and self.scheduler.cache_events)
            ):
                return PrefillPoll(failures, self.cache_events())
            time.sleep(POLL_CHECK_S)

    def stats(self) -> PrefillStats:
        with self._lock:
            requests = list(self.scheduler.requests.values())
            num_sending = sum(r.state is RequestState.SENDING for r in requests)
            return PrefillStats(
                self.worker_id,
                len(requests) - num_sending,
                self.scheduler.queued_tokens,
                num_sending,
                self.num_used_pages,
                self.num_pages,
                self._kv_bytes_sent,
                self._num_send_failures,
                *self.step_timing(),
                **prefix_cache_counts(self.scheduler),
                **host_tier_counts(self),
                **expert_balance_counts(self),
                kv_pages_sent=self._kv_pages_sent,
                kv_pages_not_sent=self._kv_pages_not_sent,
                kv_bytes_not_sent=self._kv_pages_not_sent * self.runner.cache.layout.page_bytes,
            )

    def step(self) -> bool:
        """Runs one forward pass over the next chunks; returns False when there was nothing to do. The forward
        runs without the worker's lock, so `submit` and `abort` never wait for it."""
        with self._lock:
            plan, _ = self.scheduler.schedule()  # nothing is preempted here: no request decodes
        if plan is None:
            return False
        outcome = self._run_plan(plan)
        with self._lock:
            for out in outcome.outputs:  # the requests of a failed pass, aborted by the scheduler
                self._report(out.request_id, out.error)
        for request, first_token, logprobs in outcome.to_send:
            self._sends.submit(self._send, request, first_token, logprobs)
        return True

    def warm_up(self) -> None:
        """Prompt chunks up to `max_prefill_chunk` tokens."""
        c = self.config
        self._warm_up(c.max_prefill_chunk, 0, 0, c.max_num_batched_tokens)

    def close(self) -> None:
        self._sends.shutdown(wait=True, cancel_futures=False)
        self.sender.close()
        self.close_ranks()

    def _fail(self, request_id: str, error: str) -> None:
        """Under the lock: forget the request, free its pages, report it."""
        self.scheduler.abort(request_id)
        self._report(request_id, error)

    def _report(self, request_id: str, error: str | None) -> None:
        self._aborted.discard(request_id)
        self._failures.append(
            PrefillFailure(request_id, f"prefill worker {self.worker_id}: {error}")
        )

    def _send(self, request: Request, first_token: int, logprobs: TokenLogprobs | None) -> None:
        r: PrefillRequest = request.payload
        with self._lock:
            if (
                r.request_id in self._aborted
            ):  # aborted while queued (e.g. its decode worker was lost)
                self._aborted.discard(r.request_id)
                self.scheduler.release(r.request_id)
                return
        try:
            start = time.perf_counter()
            # the stages known now: the transfer's wait ends here, the decode worker adds the transfer
            handoff = PrefillHandoff(
                logprobs, stage_times(request, time.monotonic()), tuple(request.draft_ids),
                request.num_cached_tokens or 0,
                None if request.prompt_logprobs is None else PackedLogprobs.of(request.prompt_logprobs),
            )  # fmt: skip
            # the decode worker's first pages it holds already (its prefix cache) stay here
            pages = list(request.pages[r.num_held_pages :])
            self.sender.send(
                r.decode_peer, r.transfer_id, self.runner.cache.data, pages,
                len(r.token_ids), first_token, r.dest_cuts, handoff.to_bytes(),
            )  # fmt: skip
            logger.debug(
                "sent %s: %d pages (%d held there) in %.1f ms", r.request_id, len(pages),
                r.num_held_pages, 1e3 * (time.perf_counter() - start),
            )  # fmt: skip
            error = None
        except PdserveError as e:
            error = str(e)
        except Exception as e:  # thread boundary
            logger.error("send of %s failed", r.request_id, exc_info=True)
            error = f"KV send failed: {e}"
        with self._lock:
            if error is None:
                self._kv_pages_sent += len(pages)
                self._kv_pages_not_sent += r.num_held_pages
                self._kv_bytes_sent += len(pages) * self.runner.cache.layout.page_bytes
            else:
                self._num_send_failures += 1
                if r.request_id not in self._aborted:
                    self._fail(r.request_id, error)
                    return
            self._aborted.discard(r.request_id)
            self.scheduler.release(r.request_id)
