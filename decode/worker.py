"""`DecodeWorker`: holds requests' KV pages, runs the continuous decode batch and streams tokens: the decode role
over the engine's scheduler (a request with a prefill peer is `Policy.DECODE_ONLY`, one without is
`Policy.AGGREGATED`) and the KV import.

A plain class (Ray wraps it in pdserve.cluster). Control calls (`add_request`, `abort`, `stats`) may come from any
thread; `step` runs on the worker's loop thread, its forward passes without the worker's lock (a page freed
meanwhile is held back until the step ends, since the pass may still write it). KV pages arrive through a
`KVReceiver` writing straight into the cache, with what the prefill worker knows of the request beyond them
(`PrefillHandoff`: the first token's log-probabilities, its stage times), so that the request's first output here is
complete; with no prefill peer the worker prefills the request itself (the aggregated path). Outputs of each step
are queued as one batch for `poll_outputs`.

Decode-side reuse (`DecodeConfig.reuse_held_prefix`, with the prefix cache): the full pages of the KV that
arrives stay in this worker's prefix cache, and those of finished requests (`Scheduler.reuse_held`). A request
whose first pages are cached here when it is placed takes references to them in `add_request`, so that nothing
evicts them before its KV arrives (a page evicted before that is simply not held), and its `Reservation` says
how many (`num_held_pages`): the prefill worker sends only the pages after them, into the pages reserved for
them (the receiver writes nowhere else). A transfer that fails or a request aborted frees the held pages'
references with the rest; they stay cached.

A worker of several ranks whose ranks hold KV endpoints (`pdserve.engine.ranks.kv`) receives each request's pages
on the rank that holds it: `add_request` names that rank's endpoint in its `Reservation`, and what the ranks are
to expect or cancel travels with the next step round (a round with no plan carries it when no step is due, and
polls the ranks while transfers are awaited).
"""

from __future__ import annotations

import dataclasses
import queue
import time

from pdserve import kernels
from pdserve.engine.drafter import check_speculation
from pdserve.engine.messages import (
    DecodePoll,
    DecodeRequest,
    DecodeStats,
    PrefillHandoff,
    RequestOutput,
    Reservation,
)
from pdserve.engine.ranks.group import RankGroup
from pdserve.engine.ranks.kv import RankKVControl, rank_endpoint
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.spec_policy import SpecPolicy
from pdserve.engine.worker import (
    Worker,
    expert_balance_counts,
    host_tier_counts,
    prefix_cache_counts,
)
from pdserve.kvtransfer import ExpectedTransfer, KVReceiver, MakeReceiver, TransferResult
from pdserve.model.deepseek import Transformer
from pdserve.model.errors import TransferError

from .config import DecodeConfig


class DecodeWorker(Worker):
    idle_wait_s = 0.005

    def __init__(
        self,
        worker_id: str,
        model: Transformer | None,
        config: DecodeConfig,
        make_receiver: MakeReceiver | None = None,
        kv_cache_dtype: str = "auto",
        ranks: RankGroup | None = None,
        runner: ModelRunner | None = None,
    ):
        """kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`); must be the prefill workers'; ranks: the
        worker's running rank group when `config.layout.ranks` > 1 (`Worker`; then `model` is unused); runner: a
        runner to step instead of one over `model` (`Worker`)."""
        super().__init__(
            worker_id, model, config, kv_cache_dtype, cuda_graphs=config.cuda_graphs, ranks=ranks,
            runner=runner,
        )  # fmt: skip
        args = self.model.args
        self.scheduler = self._make_scheduler(
            config.page_size, config.max_num_batched_tokens,
            config.max_prefill_chunk, args.vocab_size, args.max_position_embeddings, args.eos_token_ids,
            max_running=config.max_running, fixed_chunks=kernels.batch_invariant(),
            worker_kind="decode worker", replay_generated=kernels.batch_invariant(),
            num_drafts=check_speculation(self.model, config.num_speculative_tokens),
            spec_policy=SpecPolicy(
                config.num_speculative_tokens, config.speculative_max_batch,
                config.speculative_min_acceptance,
            ),
            relaxed=(config.speculative_relaxed_topk, config.speculative_relaxed_delta),
            prefix_caching=config.enable_prefix_caching, reuse_held=config.reuse_held_prefix,
        )  # fmt: skip
        self.receiver: KVReceiver | None = (
            make_receiver(self.runner.cache.data) if make_receiver else None
        )
        kv = None if ranks is None else ranks.handler.kv
        self.rank_kv = None if kv is None else RankKVControl(self.num_ranks)
        """What the ranks are to expect or cancel, when they receive the KV themselves."""
        self._advisor = self.receiver if kv is None else kv.receiver
        """The receiver whose cut advice goes back to the router (every rank's cache has its shape)."""
        self._outputs: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()

    def add_request(self, request: DecodeRequest) -> Reservation:
        """Admits a request, taking pages for its prompt (and tokens generated before a preemption). With a
        prefill peer the pages wait for that worker's transfer; without, this worker prefills them.
        Raises InvalidRequestError (never fits) or CapacityError (full right now)."""
        with self._lock:
            if request.prefill_peer is not None and self._advisor is None:
                raise ValueError(f"{self.worker_id} has no KV receiver: prefill_peer must be None")
            policy = Policy.AGGREGATED if request.prefill_peer is None else Policy.DECODE_ONLY
            tokens = [*request.prompt_token_ids, *request.generated_token_ids]
            record = Request(
                request.request_id, tokens, request.params, policy,
                len(request.generated_token_ids), payload=request,
            )  # fmt: skip
            self.scheduler.add(record)
            cuts, endpoint = (), ""
            # the pages held here already (referenced: never evicted while it lives) do not travel
            held = record.num_held_pages
            dest = list(record.pages[held:])
            if request.prefill_peer is not None and self.rank_kv is not None:
                what = f"transfer {record.transfer_id}"
                cuts = self._advisor.advise(dest, what)
                self.rank_kv.expect(
                    record.rank, record.transfer_id, request.prefill_peer, dest,
                    self.config.kv_wait_timeout_s,
                )  # fmt: skip
                endpoint = rank_endpoint(self.worker_id, record.rank)
            elif request.prefill_peer is not None:
                deadline = time.monotonic() + self.config.kv_wait_timeout_s
                cuts = self.receiver.expect(
                    ExpectedTransfer(record.transfer_id, request.prefill_peer, dest, deadline)
                )
        self._wake.set()
        return Reservation(record.transfer_id, len(record.pages), tuple(cuts), endpoint, held)

    def abort(self, request_id: str) -> None:
        """Cancels a request and frees its pages; its last output says finish_reason=abort."""
        with self._lock:
            record = self.scheduler.requests.get(request_id)
            if record is None:
                return
            held: list[int] | None = None
            if record.state is RequestState.WAITING_FOR_KV and self.rank_kv is not None:
                # its rank may be writing them: they are freed once the rank has cancelled
                pages, record.pages = record.pages, []
                held = self.rank_kv.cancel(record.rank, record.transfer_id, pages)
            elif record.state is RequestState.WAITING_FOR_KV:
                self.receiver.cancel(record.transfer_id)  # no page write after this returns
            outputs = self.scheduler.abort(request_id)
            if held:
                self.allocators[record.rank].free(held)
        self._emit(outputs)

    def poll_outputs(self, timeout_s: float = 0.0) -> list[RequestOutput]:
        """Outputs since the last call, oldest first; waits up to timeout_s for the first batch."""
        out: list[RequestOutput] = []
        try:
            out.extend(
                self._outputs.get(timeout=timeout_s)
                if timeout_s > 0
                else self._outputs.get_nowait()
            )
        except queue.Empty:
            return out
        while True:
            try:
                out.extend(self._outputs.get_nowait())
            except queue.Empty:
                return out

    def poll(self, timeout_s: float = 0.0) -> DecodePoll:
        """The router's long-poll: `poll_outputs`, with the prefix cache's events since the last poll (those of
        the steps whose outputs come here included)."""
        outputs = self.poll_outputs(timeout_s)
        return DecodePoll(outputs, self.cache_events())

    def stats(self) -> DecodeStats:
        step_s, step_expected_s = self.step_timing()
        with self._lock:
            records = list(self.scheduler.requests.values())
            spec = self.scheduler.spec_stats
            return DecodeStats(
                self.worker_id,
                sum(r.state is RequestState.RUNNING for r in records),
                sum(r.state is not RequestState.RUNNING for r in records),
                self.num_used_pages,
                self.num_pages,
                self.config.max_running,
                self.config.page_size,
                self.scheduler.num_preemptions,
                spec=spec.totals(),
                spec_accepted_per_position=tuple(spec.accepted_per_position),
                step_s=step_s,
                step_expected_s=step_expected_s,
                **prefix_cache_counts(self.scheduler),
                **host_tier_counts(self),
                **expert_balance_counts(self),
                kv_held_pages=self.scheduler.num_held_pages,
            )

    def can_admit(self, num_tokens: int) -> bool:
        with self._lock:
            return self.scheduler.can_admit(num_tokens)

    def step(self) -> bool:
        """Takes arrived KV, then runs one step: a local-prefill pass and a decode pass. False when idle. The
        forward passes run without the worker's lock (control calls never wait for them)."""
        with self._lock:
            outputs: list[RequestOutput] = []
            if self.receiver is not None:
                for result in self.receiver.poll():
                    outputs += self._arrived(result)
            plan, planned = self.scheduler.schedule()
            outputs += planned
            control = poll = None
            if self.rank_kv is not None:
                control, poll = self.rank_kv.take(), bool(self.rank_kv.awaited)
        if plan is not None or control is not None or poll:
            outcome, arrivals = self._run_round(plan, control)
            outputs += outcome.outputs
            if self.rank_kv is not None and self.failed is None:
                with self._lock:
                    for rank, pages in self.rank_kv.delivered():
                        self.allocators[rank].free(pages)
                    for result in self.rank_kv.arrived(arrivals):
                        outputs += self._arrived(result)
        self._emit(outputs)
        return bool(plan is not None or outputs)

    def _arrived(self, result: TransferResult) -> list[RequestOutput]:
        """Under the lock: a transfer arrived (or failed). Its request's first output carries what the prefill
        worker sent with the pages (`PrefillHandoff`): the first token's log-probabilities, and its stages with
        the transfer's own time here added to its `kv_transfer_s`."""
        if result.error is not None:
            return self.scheduler.kv_failed(result.transfer_id, result.error)
        try:
            handoff = PrefillHandoff.from_bytes(result.metadata)
            prompt = handoff.prompt_logprobs
            prompt_logprobs = None if prompt is None else prompt.unpacked()
        except TransferError as e:
            return self.scheduler.kv_failed(
                result.transfer_id, f"transfer {result.transfer_id}: {e}"
            )
        stages = handoff.stages
        if result.started_at is not None and result.completed_at is not None:
            moved_s = max(0.0, result.completed_at - result.started_at)
            stages = dataclasses.replace(stages, kv_transfer_s=stages.kv_transfer_s + moved_s)
        return self.scheduler.kv_arrived(
            result.transfer_id, result.num_tokens, result.first_token, handoff.logprobs, stages,
            handoff.draft_ids, handoff.cached_tokens, prompt_logprobs,
        )  # fmt: skip

    def warm_up(self) -> None:
        """Prompt chunks up to `max_prefill_chunk` (the aggregated path) and a decode graph for every bucket of
        up to the rows one rank runs (`Scheduler.max_rows`: its requests, with their drafts' rows where it
        speculates) and `warm_up_context` tokens."""
        c = self.config
        self._warm_up(
            c.max_prefill_chunk, self.scheduler.max_rows, c.warm_up_context,
            c.max_num_batched_tokens,
        )  # fmt: skip

    def _ranks_failed(self) -> None:
        if self.rank_kv is not None:  # the ranks are gone: nothing writes the held pages any more
            for rank, pages in self.rank_kv.drop():
                self.allocators[rank].free(pages)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._outputs.put(outputs)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.close_ranks()
