"""The decode worker's scheduler: admission by free pages, continuous batching, preemption by recompute, stop
rules. Pure Python (no torch): it decides, the worker executes.

A request is admitted with pages for every token whose KV it will receive (or compute itself, when it has no
prefill peer: the aggregated path). It then waits for its KV, runs one token per step until a stop rule fires, and
frees its pages. When a running request needs a new page and none is free, the most recently admitted requests are
preempted: their pages are freed and they go back through prefill with the tokens generated so far (locally, or
via the router for remote prefill), which reproduces the same continuation (sampling depends only on seed and step).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Collection

from pdserve.engine.messages import DecodeRequest, RequestOutput
from pdserve.model.checks import check_context, check_pages, check_token_ids
from pdserve.model.chunking import plan_prefill_chunks
from pdserve.model.errors import CapacityError, InvalidRequestError
from pdserve.model.pages import PageAllocator, pages_needed
from pdserve.model.sampling_params import FinishReason, check_stop


class RequestState(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"
    PREFILLING = "prefilling"
    """Local prefill (aggregated path), possibly across several steps."""
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass
class DecodeSeq:
    request: DecodeRequest
    state: RequestState
    token_ids: list[int]
    """Prompt, then every generated token."""
    num_generated: int
    pages: list[int]
    admit_order: int
    transfer_id: int = 0
    num_computed: int = 0
    """Tokens whose KV is in the cache."""

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass
class StepPlan:
    prefill: list[tuple[DecodeSeq, int, int]]
    """Local prefill chunks: (seq, start, length)."""
    decode: list[DecodeSeq]
    outputs: list[RequestOutput]
    """Produced while planning (preemptions)."""


class DecodeScheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_running: int,
        token_budget: int,
        max_chunk: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Collection[int],
        fixed_chunks: bool = False,
    ):
        """fixed_chunks: cut prompts only at multiples of the chunk size (`plan_prefill_chunks`)."""
        self.allocator, self.page_size = allocator, page_size
        self.fixed_chunks = fixed_chunks
        self.max_running, self.token_budget, self.max_chunk = max_running, token_budget, max_chunk
        self.vocab_size, self.max_model_len, self.eos_token_ids = (
            vocab_size,
            max_model_len,
            eos_token_ids,
        )
        self.seqs: dict[str, DecodeSeq] = {}
        self._waiting_local: list[DecodeSeq] = []
        """Preempted local requests waiting for pages to be prefilled again, oldest first."""
        self._by_transfer: dict[int, DecodeSeq] = {}
        self.num_preemptions = 0
        self._admitted = itertools.count()
        self._transfer_ids = itertools.count(1)

    # Admission.

    def validate(self, request: DecodeRequest) -> None:
        """Raises InvalidRequestError naming the field when the request can never run on this model."""
        if request.request_id in self.seqs:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        num_prompt, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
        check_token_ids(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        check_context(num_prompt, max_tokens, self.max_model_len)
        check_pages(
            num_prompt + max_tokens, self.page_size, self.allocator.num_pages, "this decode worker"
        )

    def can_admit(self, num_tokens: int) -> bool:
        return (
            self.num_active < self.max_running
            and not self._waiting_local
            and self.allocator.can_allocate(pages_needed(num_tokens, self.page_size))
        )

    @property
    def num_active(self) -> int:
        return len(self.seqs)

    def admit(self, request: DecodeRequest) -> DecodeSeq:
        """Takes pages for the request's known tokens. Raises CapacityError when they are not free now."""
        self.validate(request)
        tokens = [*request.prompt_token_ids, *request.generated_token_ids]
        if not self.can_admit(len(tokens)):
            raise CapacityError(
                f"decode worker full: {self.allocator.num_free} free KV pages, "
                f"{self.num_active}/{self.max_running} requests"
            )
        local = request.prefill_peer is None
        seq = DecodeSeq(
            request,
            RequestState.PREFILLING if local else RequestState.WAITING_FOR_KV,
            tokens,
            len(request.generated_token_ids),
            self.allocator.allocate(pages_needed(len(tokens), self.page_size)),
            next(self._admitted),
        )
        if not local:
            seq.transfer_id = next(self._transfer_ids)
            self._by_transfer[seq.transfer_id] = seq
        self.seqs[request.request_id] = seq
        return seq

    # Events.

    def kv_arrived(
        self, transfer_id: int, num_tokens: int, first_token: int
    ) -> list[RequestOutput]:
        seq = self._by_transfer.pop(transfer_id, None)
        if seq is None or seq.state is not RequestState.WAITING_FOR_KV:
            return []
        if num_tokens != len(seq.token_ids):
            return self._abort(
                seq, f"KV for {num_tokens} tokens arrived, expected {len(seq.token_ids)}"
            )
        seq.num_computed = num_tokens
        seq.state = RequestState.RUNNING
        return self._append(seq, first_token)

    def kv_failed(self, transfer_id: int, error: str) -> list[RequestOutput]:
        seq = self._by_transfer.pop(transfer_id, None)
        if seq is None or seq.state is not RequestState.WAITING_FOR_KV:
            return []
        return self._abort(seq, error)

    def abort(self, request_id: str, error: str | None = None) -> list[RequestOutput]:
        seq = self.seqs.get(request_id)
        return [] if seq is None else self._abort(seq, error)

    def _abort(self, seq: DecodeSeq, error: str | None) -> list[RequestOutput]:
        self._release(seq, RequestState.ABORTED)
        return [RequestOutput(seq.request_id, [], FinishReason.ABORT, error)]

    def _release(self, seq: DecodeSeq, state: RequestState) -> None:
        seq.state = state
        self.allocator.free(seq.pages)
        seq.pages = []
        self.seqs.pop(seq.request_id, None)
        self._by_transfer.pop(seq.transfer_id, None)
        if seq in self._waiting_local:
            self._waiting_local.remove(seq)

    def _append(self, seq: DecodeSeq, token: int) -> list[RequestOutput]:
        seq.token_ids.append(token)
        seq.num_generated += 1
        reason = check_stop(seq.request.params, token, seq.num_generated, self.eos_token_ids)
        if reason is not None:
            self._release(seq, RequestState.FINISHED)
        return [RequestOutput(seq.request_id, [token], reason)]

    # Steps.

    def schedule(self) -> StepPlan:
        outputs: list[RequestOutput] = []
        self._readmit_local()
        prefilling = [
            s for s in self.seqs.values() if s.state is RequestState.PREFILLING and s.pages
        ]
        pending = [(s.request_id, s.num_computed, len(s.token_ids)) for s in prefilling]
        chunks = plan_prefill_chunks(pending, self.token_budget, self.max_chunk, self.fixed_chunks)
        prefill = [(self.seqs[rid], start, length) for rid, start, length in chunks]
        decode = []
        running = sorted(
            (s for s in self.seqs.values() if s.state is RequestState.RUNNING),
            key=lambda s: s.admit_order,
        )
        for seq in running:
            if seq.state is not RequestState.RUNNING:
                continue  # preempted while making room for an earlier one
            need = pages_needed(len(seq.token_ids), self.page_size) - len(seq.pages)
            while need > 0 and not self.allocator.can_allocate(need):
                victim = self._pick_victim(exclude=seq, protected=decode)
                if victim is None:
                    break
                outputs.extend(self._preempt(victim))
                prefill = [c for c in prefill if c[0] is not victim]
            if need > 0 and not self.allocator.can_allocate(need):
                outputs.extend(self._preempt(seq))
                continue
            if need > 0:
                seq.pages.extend(self.allocator.allocate(need))
            decode.append(seq)
        return StepPlan(prefill, decode, outputs)

    def _pick_victim(self, exclude: DecodeSeq, protected: list[DecodeSeq]) -> DecodeSeq | None:
        """The most recently admitted request holding pages, other than `exclude` and those already planned."""
        candidates = [s for s in self.seqs.values() if s is not exclude and s not in protected
                      and s.pages and s.state in (RequestState.RUNNING, RequestState.PREFILLING)]  # fmt: skip
        return max(candidates, key=lambda s: s.admit_order, default=None)

    def _preempt(self, seq: DecodeSeq) -> list[RequestOutput]:
        self.num_preemptions += 1
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        if seq.request.prefill_peer is None:
            seq.state = RequestState.PREFILLING
            self._waiting_local.append(seq)
            return []
        self._release(seq, RequestState.ABORTED)
        return [RequestOutput(seq.request_id, [], preempted=True)]

    def _readmit_local(self) -> None:
        while self._waiting_local:
            seq = self._waiting_local[0]
            need = pages_needed(len(seq.token_ids), self.page_size)
            if not self.allocator.can_allocate(need):
                return
            seq.pages = self.allocator.allocate(need)
            self._waiting_local.pop(0)

    def prefill_done(self, seq: DecodeSeq, start: int, length: int, token: int | None):
        """After a local prefill chunk; `token` is sampled after the last chunk."""
        if seq.state is not RequestState.PREFILLING:
            return []
        seq.num_computed = start + length
        if token is None:
            return []
        seq.state = RequestState.RUNNING
        return self._append(seq, token)

    def decode_done(self, seqs: list[DecodeSeq], tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.state is RequestState.RUNNING:
                seq.num_computed = len(seq.token_ids)
                outputs.extend(self._append(seq, token))
        return outputs
