"""The per-step plan: what each rank runs this step, the only thing the scheduler hands the runner, and what the
runner hands back. Plain data (ints, lists, `SamplingParams`): `encode_plan` / `decode_plan` and
`encode_result` / `decode_result` turn them into msgpack bytes and back, so a driver can send a step to rank
processes. Pure Python (no torch).

A rank's step is at most two forward passes, run in this order: one prefill pass over prompt chunks (each
writes its KV; a request's last chunk samples its next token) and one decode pass of one token per request."""

from __future__ import annotations

import dataclasses

from .messages import decode, encode
from .sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to sample a row's next token."""

    params: SamplingParams
    """Must carry a seed (SamplingParams.with_seed)."""
    step: int
    """How many tokens the request generated before this one (the draw depends only on seed and step)."""


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


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeRow:
    """One request's decode token: its last token runs at `position` and the next token is sampled."""

    request_id: str
    token_id: int
    position: int
    page_ids: list[int]
    """The request's pages in position order, covering `position`."""
    sample: SampleSpec


@dataclasses.dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's share of a step; either list may be empty (an idle rank still takes part in the step)."""

    prefill: list[PrefillRow] = dataclasses.field(default_factory=list)
    decode: list[DecodeRow] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    """Increases by one per step a scheduler plans; results carry it back."""
    ranks: list[RankStep]
    """Indexed by rank."""


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


def encode_plan(plan: StepPlan) -> bytes:
    return encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    return decode(StepPlan, data)


def encode_result(result: RankResult) -> bytes:
    return encode(result)


def decode_result(data: bytes) -> RankResult:
    return decode(RankResult, data)
