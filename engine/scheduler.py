"""`Scheduler`: the one scheduling core every role runs. Pure Python (no torch): it decides, the runner executes.

One set of queues over one kind of record (`Request`): the arrival-ordered table of live requests, the queue of
those waiting for pages, and the transfers expected from prefill workers. A request's `Policy` picks its path
(prefill-only for a prefill worker, decode-only or aggregated for a decode worker, aggregated for the offline
path). A step is `schedule()` -> `StepPlan` -> the runner's `RankResult`s -> `finish_step()`:

- waiting requests take their pages in arrival order, the head of the queue blocking the rest;
- prefilling requests get chunks under the step's token budget, first come first served (`plan_prefill_chunks`);
- running requests each run one decode token, oldest first; one that needs a page nobody has free preempts the
  most recently admitted requests (their pages freed; an aggregated one is prefilled again later with the tokens
  generated so far, a decode-only one is handed back to the router), or is preempted itself;
- after the step, sampled tokens are appended and the stop rules applied.

Pages freed while a step is in flight (an abort from another thread) are held back until `finish_step`, since
the step's forward passes may still write them."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Collection, Sequence

from pdserve.model.errors import CapacityError, InvalidRequestError

from .checks import check_context, check_pages, check_token_ids
from .chunking import plan_prefill_chunks
from .messages import RequestOutput
from .pages import PageAllocator, pages_needed
from .request import Policy, Request, RequestState
from .sampling_params import FinishReason, check_stop
from .step import DecodeRow, PrefillRow, RankResult, RankStep, SampleSpec, StepPlan


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutcome:
    outputs: list[RequestOutput]
    """Tokens appended, finishes and aborts, in request order: this step's prefill rows, then its decode rows."""
    to_send: list[tuple[Request, int]]
    """PREFILL_ONLY requests whose prefill ended this step, with their first token: the role exports their KV and
    then calls `release` (or `abort`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _InFlight:
    plan: StepPlan
    prefill: list[tuple[Request, int, int]]
    """(request, start, length) per prefill row of rank 0."""
    decode: list[Request]


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        token_budget: int,
        max_chunk: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Collection[int],
        max_running: int | None = None,
        fixed_chunks: bool = False,
        worker_kind: str = "worker",
    ):
        """token_budget, max_chunk: prompt tokens per step, and per request per step; max_running: requests
        admitted at once (None: no limit); fixed_chunks (batch-invariant mode): cut prompts only at multiples of
        the chunk size (`plan_prefill_chunks`); worker_kind: how refusals name this worker ("decode worker")."""
        self.allocator, self.page_size = allocator, page_size
        self.token_budget, self.max_chunk, self.fixed_chunks = token_budget, max_chunk, fixed_chunks
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_running, self.worker_kind = max_running, worker_kind
        self.requests: dict[str, Request] = {}
        """Every live request, in arrival order."""
        self.waiting: deque[Request] = deque()
        """WAITING requests, in the order they take pages."""
        self._by_transfer: dict[int, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._step_ids = itertools.count()
        self._in_flight: _InFlight | None = None

    # Admission.

    def check(self, request: Request) -> None:
        """Raises InvalidRequestError naming the field, or CapacityError, when the request can never run here."""
        if request.request_id in self.requests:
            taken = "queued" if request.policy is Policy.PREFILL_ONLY else "running"
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already {taken}")
        check_token_ids(request.token_ids, self.vocab_size, "prompt_token_ids")
        holder = f"this {self.worker_kind}"
        if request.policy is Policy.PREFILL_ONLY:
            check_pages(request.num_tokens, self.page_size, self.allocator.num_pages, holder)
            return
        max_tokens = request.params.max_tokens
        check_context(request.num_prompt_tokens, max_tokens, self.max_model_len)
        need = request.num_prompt_tokens + max_tokens
        check_pages(need, self.page_size, self.allocator.num_pages, holder)

    @property
    def num_active(self) -> int:
        return len(self.requests)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request with `num_tokens` known tokens would get its pages now."""
        return (
            (self.max_running is None or self.num_active < self.max_running)
            and not self.waiting
            and self.allocator.can_allocate(pages_needed(num_tokens, self.page_size))
        )

    def add(self, request: Request) -> None:
        """Admits a request. PREFILL_ONLY: queued, pages taken when it reaches the head of the queue. Otherwise
        its known tokens' pages are taken now (CapacityError when not free now) and, DECODE_ONLY, it gets a
        `transfer_id` for the prefill worker's transfer."""
        self.check(request)
        if request.policy is Policy.PREFILL_ONLY:
            request.state = RequestState.WAITING
            self.waiting.append(request)
        else:
            if not self.can_admit(request.num_tokens):
                raise CapacityError(
                    f"{self.worker_kind} full: {self.allocator.num_free} free KV pages, "
                    f"{self.num_active}/{self.max_running} requests"
                )
            request.pages = self.allocator.allocate(
                pages_needed(request.num_tokens, self.page_size)
            )
            if request.policy is Policy.DECODE_ONLY:
                request.state = RequestState.WAITING_FOR_KV
                request.transfer_id = next(self._transfer_ids)
                self._by_transfer[request.transfer_id] = request
            else:
                request.state = RequestState.PREFILLING
        request.admit_order = next(self._arrivals)
        self.requests[request.request_id] = request

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet prefilled (the router's load measure for a prefill worker)."""
        return sum(
            r.num_tokens - r.num_computed
            for r in self.requests.values()
            if r.state in (RequestState.WAITING, RequestState.PREFILLING)
        )

    # Events.

    def kv_arrived(
        self, transfer_id: int, num_tokens: int, first_token: int
    ) -> list[RequestOutput]:
        request = self._by_transfer.pop(transfer_id, None)
        if request is None or request.state is not RequestState.WAITING_FOR_KV:
            return []
        if num_tokens != request.num_tokens:
            return self._abort(
                request, f"KV for {num_tokens} tokens arrived, expected {request.num_tokens}"
            )
        request.num_computed = num_tokens
        request.state = RequestState.RUNNING
        return self._append(request, first_token)

    def kv_failed(self, transfer_id: int, error: str) -> list[RequestOutput]:
        request = self._by_transfer.pop(transfer_id, None)
        if request is None or request.state is not RequestState.WAITING_FOR_KV:
            return []
        return self._abort(request, error)

    def abort(self, request_id: str, error: str | None = None) -> list[RequestOutput]:
        """Forgets a request in any state and frees its pages; its output says finish_reason=abort."""
        request = self.requests.get(request_id)
        return [] if request is None else self._abort(request, error)

    def release(self, request_id: str) -> None:
        """A SENDING request's export is over: it is finished here and its pages are freed."""
        request = self.requests.get(request_id)
        if request is not None:
            self._release(request, RequestState.FINISHED)

    def _abort(self, request: Request, error: str | None) -> list[RequestOutput]:
        self._release(request, RequestState.ABORTED)
        return [RequestOutput(request.request_id, [], FinishReason.ABORT, error)]

    def _release(self, request: Request, state: RequestState) -> None:
        request.state = state
        self.allocator.free(request.pages)
        request.pages = []
        self.requests.pop(request.request_id, None)
        self._by_transfer.pop(request.transfer_id, None)
        if request in self.waiting:
            self.waiting.remove(request)

    def _append(self, request: Request, token: int) -> list[RequestOutput]:
        request.token_ids.append(token)
        request.num_generated += 1
        reason = check_stop(request.params, token, request.num_generated, self.eos_token_ids)
        if reason is not None:
            self._release(request, RequestState.FINISHED)
        return [RequestOutput(request.request_id, [token], reason)]

    # Steps.

    def schedule(self) -> tuple[StepPlan | None, list[RequestOutput]]:
        """The next step's plan (None when there is nothing to run) and the outputs planning produced
        (preempted decode-only requests). A plan must be finished (`finish_step`) before the next one."""
        assert self._in_flight is None, "the previous step is not finished"
        outputs: list[RequestOutput] = []
        self._take_pages_in_order()
        prefilling = [r for r in self.requests.values() if r.state is RequestState.PREFILLING]
        pending = [(r, r.num_computed, r.num_tokens) for r in prefilling]
        prefill = plan_prefill_chunks(pending, self.token_budget, self.max_chunk, self.fixed_chunks)
        decode: list[Request] = []
        running = sorted(
            (r for r in self.requests.values() if r.state is RequestState.RUNNING),
            key=lambda r: r.admit_order,
        )
        for request in running:
            if request.state is not RequestState.RUNNING:
                continue  # preempted while making room for an earlier one
            need = pages_needed(request.num_tokens, self.page_size) - len(request.pages)
            while need > 0 and not self.allocator.can_allocate(need):
                victim = self._pick_victim(exclude=request, protected=decode)
                if victim is None:
                    break
                outputs.extend(self._preempt(victim))
                prefill = [c for c in prefill if c[0] is not victim]
            if need > 0 and not self.allocator.can_allocate(need):
                outputs.extend(self._preempt(request))
                continue
            if need > 0:
                request.pages.extend(self.allocator.allocate(need))
            decode.append(request)
        if not prefill and not decode:
            return None, outputs
        plan = StepPlan(next(self._step_ids), [self._rank_step(prefill, decode)])
        self._in_flight = _InFlight(plan, prefill, decode)
        self.allocator.hold_frees()
        return plan, outputs

    @staticmethod
    def _rank_step(
        prefill: Sequence[tuple[Request, int, int]], decode: Sequence[Request]
    ) -> RankStep:
        prefill_rows = []
        for request, start, length in prefill:
            last = start + length == request.num_tokens
            sample = SampleSpec.of(request.params, request.num_generated) if last else None
            chunk = request.token_ids[start : start + length]
            prefill_rows.append(
                PrefillRow(request.request_id, chunk, start, list(request.pages), sample)
            )
        decode_rows = [
            DecodeRow(
                r.request_id,
                r.token_ids[-1],
                r.num_tokens - 1,
                list(r.pages),
                SampleSpec.of(r.params, r.num_generated),
            )  # fmt: skip
            for r in decode
        ]
        return RankStep(prefill_rows, decode_rows)

    def _take_pages_in_order(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            need = pages_needed(request.num_tokens, self.page_size)
            if not self.allocator.can_allocate(need):
                return
            request.pages = self.allocator.allocate(need)
            request.state = RequestState.PREFILLING
            self.waiting.popleft()

    def _pick_victim(self, exclude: Request, protected: list[Request]) -> Request | None:
        """The most recently admitted request holding pages, other than `exclude` and those already planned."""
        candidates = [r for r in self.requests.values() if r is not exclude and r not in protected
                      and r.pages and r.state in (RequestState.RUNNING, RequestState.PREFILLING)]  # fmt: skip
        return max(candidates, key=lambda r: r.admit_order, default=None)

    def _preempt(self, request: Request) -> list[RequestOutput]:
        self.num_preemptions += 1
        self.allocator.free(request.pages)
        request.pages = []
        request.num_computed = 0
        if request.policy is Policy.DECODE_ONLY:
            self._release(request, RequestState.ABORTED)
            return [RequestOutput(request.request_id, [], preempted=True)]
        request.state = RequestState.WAITING
        self.waiting.append(request)
        return []

    def finish_step(self, plan: StepPlan, results: Sequence[RankResult]) -> StepOutcome:
        """Applies the ranks' results of `plan` (the last plan `schedule` returned). Rows of requests aborted
        while the step ran are skipped; a failed pass aborts its requests."""
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None and in_flight.plan.step_id == plan.step_id, (
            "not the step in flight"
        )
        self.allocator.release_held()
        (result,) = results
        assert result.step_id == plan.step_id, "a result of another step"
        outputs: list[RequestOutput] = []
        to_send: list[tuple[Request, int]] = []
        for (request, start, length), token in zip(
            in_flight.prefill, result.prefill_tokens or [None] * len(in_flight.prefill), strict=True
        ):
            if request.state is not RequestState.PREFILLING:
                continue  # aborted while the step ran
            if result.prefill_error is not None:
                outputs += self._abort(request, f"prefill failed: {result.prefill_error}")
                continue
            request.num_computed = start + length
            if token is None:
                continue
            if request.policy is Policy.PREFILL_ONLY:
                request.state = RequestState.SENDING
                to_send.append((request, token))
            else:
                request.state = RequestState.RUNNING
                outputs += self._append(request, token)
        for request, token in zip(
            in_flight.decode, result.decode_tokens or [None] * len(in_flight.decode), strict=True
        ):
            if request.state is not RequestState.RUNNING:
                continue
            if result.decode_error is not None:
                outputs += self._abort(request, f"decode failed: {result.decode_error}")
                continue
            request.num_computed = request.num_tokens
            outputs += self._append(request, token)
        return StepOutcome(outputs, to_send)
