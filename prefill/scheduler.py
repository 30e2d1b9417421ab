"""The prefill worker's scheduler: a FIFO of prompts, batched into forward passes under a token budget, long
prompts split into chunks, pages allocated when a prompt starts. Pure Python (no torch)."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque

from pdserve.engine.messages import PrefillRequest
from pdserve.model.checks import check_pages, check_token_ids
from pdserve.model.chunking import plan_prefill_chunks
from pdserve.model.errors import InvalidRequestError
from pdserve.model.pages import PageAllocator, pages_needed


class PrefillState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    SENDING = "sending"


@dataclasses.dataclass
class PrefillSeq:
    request: PrefillRequest
    state: PrefillState = PrefillState.QUEUED
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.request.token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillChunk:
    seq: PrefillSeq
    start: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


class PrefillScheduler:
    def __init__(
        self, allocator: PageAllocator, page_size: int, token_budget: int, max_chunk: int,
        vocab_size: int, fixed_chunks: bool = False,
    ):  # fmt: skip
        """fixed_chunks: cut prompts only at multiples of the chunk size (`plan_prefill_chunks`)."""
        self.allocator, self.page_size = allocator, page_size
        self.fixed_chunks = fixed_chunks
        self.token_budget, self.max_chunk, self.vocab_size = token_budget, max_chunk, vocab_size
        self.seqs: dict[str, PrefillSeq] = {}
        self._order: deque[str] = deque()  # queued and prefilling, first come first served

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet prefilled (the router's load measure)."""
        return sum(s.num_tokens - s.num_computed for s in self.seqs.values()
                   if s.state is not PrefillState.SENDING)  # fmt: skip

    def add(self, request: PrefillRequest) -> None:
        if request.request_id in self.seqs:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued")
        check_token_ids(request.token_ids, self.vocab_size, "prompt_token_ids")
        check_pages(
            len(request.token_ids), self.page_size, self.allocator.num_pages, "this prefill worker"
        )
        self.seqs[request.request_id] = PrefillSeq(request)
        self._order.append(request.request_id)

    def schedule(self) -> list[PrefillChunk]:
        """Chunks for the next forward pass. A queued prompt gets all its pages when it starts; the queue waits
        (head of line) while they are not free."""
        pending = []
        for request_id in self._order:
            seq = self.seqs[request_id]
            if seq.state is PrefillState.QUEUED:
                need = pages_needed(seq.num_tokens, self.page_size)
                if not self.allocator.can_allocate(need):
                    break
                seq.pages = self.allocator.allocate(need)
                seq.state = PrefillState.PREFILLING
            pending.append((request_id, seq.num_computed, seq.num_tokens))
        plan = plan_prefill_chunks(pending, self.token_budget, self.max_chunk, self.fixed_chunks)
        return [PrefillChunk(self.seqs[rid], start, length) for rid, start, length in plan]

    def chunk_done(self, chunk: PrefillChunk) -> None:
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length
        if chunk.is_last:
            seq.state = PrefillState.SENDING
            self._order.remove(seq.request.request_id)

    def release(self, request_id: str) -> list[int]:
        """Forgets a request; returns the pages it held (the caller frees them)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return []
        if seq.state is not PrefillState.SENDING:
            self._order.remove(request_id)
        pages, seq.pages = seq.pages, []
        return pages
