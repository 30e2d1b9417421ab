"""The scheduler's record of one request: its tokens, pages, progress and state, and the policy that decides its
path through the states, and the stages it went through. Pure Python (no torch)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection
from typing import Any

from pdserve.engine.messages import SpecCounts, StageTimes
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs, min_tokens_ban


class Policy(enum.Enum):
    """Where a request's KV comes from and what follows its prefill."""

    PREFILL_ONLY = "prefill_only"
    """WAITING (pages taken at the head of the queue) -> PREFILLING -> SENDING (its first token sampled, its KV
    being exported) -> FINISHED when the role releases it."""
    DECODE_ONLY = "decode_only"
    """Pages reserved at admission -> WAITING_FOR_KV -> RUNNING (first token from the prefill worker) ->
    FINISHED. Preempted: ABORTED, reported as preempted (the router runs it again elsewhere)."""
    AGGREGATED = "aggregated"
    """Pages reserved at admission -> PREFILLING here -> RUNNING -> FINISHED. Preempted: back to WAITING, then
    prefilled again with the tokens generated so far (same continuation: sampling depends on seed and step)."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    """Queued without pages: pages are taken in arrival order, the head of the queue blocking the rest."""
    WAITING_FOR_KV = "waiting_for_kv"
    """Pages reserved; the prefill worker's transfer will fill them."""
    PREFILLING = "prefilling"
    """Prefilled here, possibly across several steps."""
    SENDING = "sending"
    """Prefill done and first token sampled; the KV pages are being exported."""
    RUNNING = "running"
    """In the decode batch, one token per step."""
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)
class Request:
    """Compared by identity: a request id may come back after an abort as a different request."""

    request_id: str
    token_ids: list[int]
    """The prompt, then every generated token (those generated before a preemption included)."""
    params: SamplingParams
    policy: Policy
    num_generated: int = 0
    """Tokens of `token_ids` generated (the sampling step of the next one)."""
    payload: Any = None
    """The role's own message for this request (the scheduler never reads it)."""
    state: RequestState = RequestState.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is in the cache."""
    admit_order: int = 0
    """Arrival order; preemption takes the latest first."""
    transfer_id: int = 0
    """DECODE_ONLY: the id the prefill worker's transfer carries."""
    rank: int = 0
    """The data-parallel rank holding its pages and running its rows (0 on a worker of one such rank)."""
    added_at: float = 0.0
    """time.monotonic() when this worker took it; the first prefill chunk planned here, the first token (sampled
    here, or arrived with its KV) and the first decode row planned here follow (0.0: not yet)."""
    first_chunk_at: float = 0.0
    first_token_at: float = 0.0
    first_decode_at: float = 0.0
    prefill_stages: StageTimes | None = None
    """DECODE_ONLY: the stages its prefill worker ran and its KV transfer, as they arrived with its KV."""
    stop_ids: frozenset[int] = dataclasses.field(init=False, repr=False)
    """`params.stop_token_ids` as a set: each sampled token is looked up in it."""
    _banned: tuple[int, ...] | None = dataclasses.field(default=None, init=False, repr=False)
    draft_ids: list[int] = dataclasses.field(default_factory=list)
    """The MTP module's drafts for the tokens after its last one, verified by its next decode step."""
    num_drafted: int = 0
    """Drafts its decode steps verified, of them accepted, and its decode steps that verified drafts
    (speculation's per-request figures)."""
    num_accepted: int = 0
    in_think: bool = False
    """With `params.relaxed_think_ids`: its tokens so far leave it inside a think block (kept by the
    scheduler: `think_state`)."""
    num_verify_steps: int = 0
    counted: bool = False
    """The runner running its rows counts its penalties and keeps its grammar matcher already (its sequence
    and constraint went with a sampled row; see `SampleSpec.penalty_ids` and `SampleSpec.grammar`); false
    again once it is preempted."""
    page_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    """The prefix cache's chained hashes of its first full pages, as far as made (`PrefixCache`)."""
    num_cached_pages: int = 0
    """Its first pages that are in the prefix cache (found there, or cached once computed)."""
    num_held_pages: int = 0
    """DECODE_ONLY, on a decode worker that reuses held pages: its first pages found in the prefix cache
    here, which its transfer does not carry (`Scheduler.reuse_held`)."""
    num_cached_tokens: int | None = None
    """Its prompt tokens found in the prefix cache when it was first given pages here, or (DECODE_ONLY)
    on its prefill worker (its usage's cached_tokens); None before."""
    cached_reported: bool = False
    """An output of it carried `num_cached_tokens` already."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Where it asked for them (`SamplingParams.prompt_logprobs`): entry i is the log-probability of prompt
    token i + 1, as far as its prefill computed them (or as they came with its KV, DECODE_ONLY)."""
    prompt_reported: bool = False
    """An output of it carried its prompt log-probabilities already."""

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)

    def banned_ids(self, eos_token_ids: Collection[int]) -> tuple[int, ...]:
        """What min_tokens holds back (`SampleSpec.banned_ids`): its stop tokens and, unless it ignores EOS,
        `eos_token_ids`; made once."""
        if self._banned is None:
            self._banned = min_tokens_ban(self.params, eos_token_ids, self.stop_ids)
        return self._banned

    def spec_counts(self) -> SpecCounts | None:
        """Its drafts verified and accepted and its verifying steps, None where it verified none."""
        if not self.num_drafted:
            return None
        return SpecCounts(self.num_drafted, self.num_accepted, self.num_verify_steps)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids) - self.num_generated


def think_state(inside: bool, tokens, think_ids: tuple[int, int]) -> bool:
    """Whether a sequence is inside a think block after `tokens`, starting `inside` (the block opens at the
    first id and closes at the second)."""
    start, end = think_ids
    for token in tokens:
        if token == start:
            inside = True
        elif token == end:
            inside = False
    return inside


def stage_times(request: Request, sent_at: float = 0.0) -> StageTimes:
    """The stages `request` went through: on this worker, its prefill's queue and run where it was prefilled
    here, the KV transfer's wait up to `sent_at` (when a prefill worker's send began), the wait for its first
    decode step where it decoded here; with those its prefill worker ran and its KV transfer
    (`Request.prefill_stages`), where it was prefilled there."""

    def between(start: float, end: float) -> float:
        return max(0.0, end - start) if start and end else 0.0

    chunk, token = request.first_chunk_at, request.first_token_at
    return StageTimes(
        prefill_queue_s=between(request.added_at, chunk),
        prefill_s=between(chunk, token),
        kv_transfer_s=between(token, sent_at),
        decode_queue_s=between(token, request.first_decode_at),
    ).merged(request.prefill_stages)
