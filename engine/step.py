"""The per-step plan: what each rank runs this step, the only thing the scheduler hands the runner, and what the
runner hands back. Plain data (strings, ints, floats and sequences of them); `pdserve.engine.ranks.wire` carries
it between processes. Pure Python (no torch, no numpy).

A rank's step is at most two forward passes, run in this order: one prefill pass over prompt chunks (each
writes its KV; a request's last chunk samples its next token) and one decode pass of one token per request, or
with speculation (`StepPlan.mtp`) a request's token and the drafts to verify as rows at consecutive positions.
With `mtp` each pass is followed by the MTP module's passes over the same rows (writing its cache layer) and,
for `num_drafts`, the drafts of the tokens after each sampled row (`pdserve.engine.speculative`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from pdserve.engine.host_tier import HostCopy
from pdserve.engine.sampling_params import (
    SamplingParams,
    StructuredOutput,
    TokenLogprobs,
    any_penalty,
    min_tokens_ban,
)

NO_LOGPROBS = -1
"""`SampleSpec.logprobs` of a request that asked for no log-probabilities."""
MAX_DRAFTS = 4
"""Draft tokens a step at most (`StepPlan.num_drafts`)."""
MAX_GRAPH_ROWS = 256
"""Decode rows of the largest CUDA-graph bucket (`cuda_graphs.BATCH_BUCKETS`): the most a speculating step
plans on one rank."""

__all__ = [
    "MAX_DRAFTS",
    "MAX_GRAPH_ROWS",
    "NO_LOGPROBS",
    "DecodeRow",
    "PrefillRow",
    "RankResult",
    "RankStep",
    "SampleSpec",
    "StepPlan",
]


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to sample a row's next token: the request's sampling fields (`SamplingParams`) and its step, and what
    of its tokens the penalties and bans need (the runner keeps nothing between steps: a request prefilled again
    elsewhere with the tokens it carries samples alike)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    step: int
    """How many tokens the request generated before this one (the draw depends only on seed and step)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = NO_LOGPROBS
    """Alternatives to report with the sampled token's log-probability; NO_LOGPROBS: none."""
    penalty_ids: tuple[int, ...] | None = None
    """For a penalized request, its whole sequence so far (prompt, then its `step` generated tokens) on the row
    where the runner starts counting its penalties (the first that samples it on this worker: its prefill's last
    chunk, its first decode row after its KV arrived, or after a preemption); None on later rows, where the
    runner goes on from the counts it keeps with the tokens it sampled (`sampler.PenaltyCounts`). So a request
    pays for its sequence once, not every step."""
    banned_ids: tuple[int, ...] = ()
    """Tokens that must not be sampled: the end-of-sequence and stop tokens while `step` < min_tokens."""
    relaxed: bool = False
    """On a verify group's row: the draft after it is judged by relaxed acceptance (`StepPlan.relaxed_topk`;
    the request opted in and the row is inside its think block)."""
    constrained: bool = False
    """The request's output is constrained (`SamplingParams.structured`): the row's logits are masked to the
    tokens its grammar allows next, by the grammar matcher the runner keeps for it
    (`pdserve.engine.grammar_masks.GrammarMatchers`)."""
    grammar: StructuredOutput | None = None
    """On a constrained request's row where the runner starts its matcher (as `penalty_ids`: the first that
    samples it on this worker), its constraint; None on later rows, where the runner goes on from the matcher
    it keeps, advanced by the tokens it sampled."""
    grammar_ids: tuple[int, ...] = ()
    """With `grammar`: the request's generated tokens so far (`step` of them), which the new matcher consumes
    before it masks this row."""

    @classmethod
    def of(
        cls, params: SamplingParams, step: int, token_ids: Sequence[int] = (),
        eos_token_ids: Collection[int] = (), counted: bool = False,
        banned_ids: tuple[int, ...] | None = None,
    ) -> SampleSpec:  # fmt: skip
        """params should carry a seed (SamplingParams.with_seed); an unset one samples as seed 0. token_ids: the
        request's tokens (prompt, then its `step` generated ones), sent for penalties (and their generated part
        for a constrained request's grammar matcher) unless `counted` (the runner keeps those already);
        eos_token_ids: what min_tokens holds back besides the request's stop tokens (unless it ignores EOS);
        banned_ids: those, made already (`Request.banned_ids`)."""
        penalty_ids = tuple(token_ids) if params.penalized and not counted else None
        grammar, grammar_ids = None, ()
        if params.structured is not None and not counted:
            grammar, grammar_ids = params.structured, tuple(token_ids[len(token_ids) - step :])
        if step >= params.min_tokens:
            banned_ids = ()
        elif banned_ids is None:
            banned_ids = min_tokens_ban(params, eos_token_ids)
        return cls(
            params.temperature, params.top_p, params.top_k, params.min_p, params.seed or 0, step,
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            NO_LOGPROBS if params.logprobs is None else params.logprobs, penalty_ids, banned_ids,
            False, params.structured is not None, grammar, grammar_ids,
        )  # fmt: skip

    @property
    def penalized(self) -> bool:
        return any_penalty(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @property
    def plain(self) -> bool:
        """No penalty, ban, constraint or log-probabilities: the sampling kernel alone samples it."""
        return (
            self.logprobs == NO_LOGPROBS
            and not self.banned_ids
            and not self.penalized
            and not self.constrained
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillRow:
    """One chunk of one request's prompt (with any tokens it generated before a preemption)."""

    request_id: str
    token_ids: list[int]
    """The chunk's tokens."""
    start: int
    """Position of the chunk's first token: the request's tokens before it are in the cache already."""
    page_ids: list[int]
    """The request's pages in position order, covering every position up to the chunk's last token."""
    sample: SampleSpec | None
    """Given on the request's last chunk only: the token after the prompt is sampled."""
    next_token: int | None = None
    """The token after the chunk where the plan runs MTP (`StepPlan.mtp`) and it is known (None on a chunk
    whose next token it samples): the MTP module's input at the chunk's last position."""
    prompt_logprobs: int = NO_LOGPROBS
    """For a request that asked for prompt log-probabilities (`SamplingParams.prompt_logprobs`): the
    alternatives to report with the log-probability of the prompt token after each of the chunk's positions
    (`RankResult.prefill_prompt_logprobs`); NO_LOGPROBS: none."""
    prompt_next: int | None = None
    """With `prompt_logprobs`: the prompt token after the chunk (None on the prompt's last chunk), scored at
    the chunk's last position."""


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeRow:
    """One request's decode token: its last token runs at `position` and the next token is sampled (a replayed
    token's row, `Scheduler.replay_generated`: a known token, its sample dropped)."""

    request_id: str
    token_id: int
    position: int
    page_ids: list[int]
    """The request's pages in position order, covering `position`."""
    sample: SampleSpec
    drafts: int = 0
    """How many of the rows after this one are drafts to verify (their tokens proposed by the MTP module for
    the positions after this row's): this row and those are the request's verify group, whose rows sample
    steps `sample.step`, +1, ... and keep the longest accepted prefix of the drafts plus one token."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's share of a step; either pass may have no rows (an idle rank still takes part in the step).
    The scheduler makes lists; a plan read from the wire holds `WireRows`."""

    prefill: Sequence[PrefillRow] = dataclasses.field(default_factory=list)
    decode: Sequence[DecodeRow] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    """Increases by one per step a scheduler plans; results carry it back."""
    ranks: list[RankStep]
    """Indexed by rank."""
    mtp: bool = False
    """Run the MTP module over the prefill pass's rows after it, and over the decode pass's where the step
    drafts, writing its cache layer (a worker that speculates plans it every step, so that the layer holds the
    positions its drafts attend to; a step that does not draft leaves its decode rows' positions stale, which
    costs acceptance, never a token: the MTP layer is a whole MoE layer)."""
    num_drafts: int = 0
    """With `mtp`: the draft tokens to propose after each sampled row of the step (0: none this step); a
    prefill row proposes at most one. The same on every rank: each runs as many draft passes."""
    relaxed_topk: int = 0
    """Relaxed acceptance for the rows marked `SampleSpec.relaxed` (greedy): a draft among the target's
    `relaxed_topk` most likely tokens within `relaxed_delta` of the best log-probability is accepted (0: off)."""
    relaxed_delta: float = 0.0
    host_copies: Sequence[Sequence[HostCopy]] = ()
    """Per rank (empty: none), the copies between its KV cache and its host pool to run before the step's
    passes, in order (`pdserve.engine.host_tier`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankResult:
    """What one rank's runner returns for its `RankStep`."""

    step_id: int
    prefill_tokens: list[int | None] = dataclasses.field(default_factory=list)
    """Per prefill row, in order: the sampled token, None where the row has no `sample`."""
    decode_tokens: list[int] = dataclasses.field(default_factory=list)
    """Per decode row, in order."""
    prefill_error: str | None = None
    """Why the prefill pass failed (then `prefill_tokens` is empty and every row of it fails)."""
    decode_error: str | None = None
    """Why the decode pass failed (then `decode_tokens` is empty)."""
    prefill_logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
    """Per prefill row, in order, where any row asked for log-probabilities (else empty): its sampled token's,
    None for a row that asked for none or sampled none."""
    decode_logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
    """Per decode row, likewise."""
    decode_accepted: list[int] = dataclasses.field(default_factory=list)
    """Where the step verified drafts (else empty), per decode row: on a verify group's first row how many
    tokens the group keeps (its accepted drafts plus one: `decode_tokens` of the group's first rows), 0 on the
    group's other rows, 1 on any other row."""
    prefill_drafts: list[list[int]] = dataclasses.field(default_factory=list)
    """Where the plan asks for drafts (else empty), per prefill row: the drafts proposed after its sampled
    token ([] for a row that sampled none)."""
    decode_drafts: list[list[int]] = dataclasses.field(default_factory=list)
    """Likewise per decode row: on the row whose token the request goes on from (a group's first row, a
    plain row, a replay's last row) the drafts for the positions after the tokens it keeps; [] elsewhere."""
    row_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    """Requests whose row failed alone (a constrained request whose grammar allows no token, or refused the
    sampled one), by request id, with why: the scheduler aborts them with it; their tokens are meaningless."""
    prefill_prompt_logprobs: list[list[TokenLogprobs] | None] = dataclasses.field(
        default_factory=list
    )
    """Per prefill row, in order, where any row asked for prompt log-probabilities (else empty): for a row
    with `prompt_logprobs`, those of the tokens after each of its positions that are prompt tokens (the
    chunk's tokens after its first, then `prompt_next`), None for the other rows."""
