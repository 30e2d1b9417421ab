"""The per-step plan: what each rank runs this step, the only thing the scheduler hands the runner, and what the
runner hands back. Plain data (strings, ints, floats and lists of them): `plan_to_wire` / `plan_from_wire` and
`result_to_wire` / `result_from_wire` turn them into plain nested lists and back, positionally (no field names,
no reflection), so a driver can send each step to rank processes cheaply (a plan channel carries such values);
`encode_*` / `decode_*` are the same as msgpack bytes. Pure Python (no torch).

A rank's step is at most two forward passes, run in this order: one prefill pass over prompt chunks (each
writes its KV; a request's last chunk samples its next token) and one decode pass of one token per request."""

from __future__ import annotations

import dataclasses

import msgpack

from .sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to sample a row's next token: the request's sampling fields (`SamplingParams`) and its step."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    step: int
    """How many tokens the request generated before this one (the draw depends only on seed and step)."""

    @classmethod
    def of(cls, params: SamplingParams, step: int) -> SampleSpec:
        """params should carry a seed (SamplingParams.with_seed); an unset one samples as seed 0."""
        return cls(
            params.temperature, params.top_p, params.top_k, params.min_p, params.seed or 0, step
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


def _sample_to_wire(sample: SampleSpec | None) -> list | None:
    if sample is None:
        return None
    return [sample.temperature, sample.top_p, sample.top_k, sample.min_p, sample.seed, sample.step]


def _sample_from_wire(fields: list | None) -> SampleSpec | None:
    return None if fields is None else SampleSpec(*fields)


def plan_to_wire(plan: StepPlan) -> list:
    """The plan as plain nested lists (what msgpack, and a plan channel, carry), field order positional."""
    ranks = [
        [
            [[r.request_id, r.token_ids, r.start, r.page_ids, _sample_to_wire(r.sample)]
             for r in rank.prefill],
            [[r.request_id, r.token_id, r.position, r.page_ids, _sample_to_wire(r.sample)]
             for r in rank.decode],
        ]
        for rank in plan.ranks
    ]  # fmt: skip
    return [plan.step_id, ranks]


def plan_from_wire(wire: list) -> StepPlan:
    step_id, ranks = wire
    return StepPlan(
        step_id,
        [
            RankStep(
                [PrefillRow(rid, ids, start, pages, _sample_from_wire(s))
                 for rid, ids, start, pages, s in prefill],
                [DecodeRow(rid, token, pos, pages, _sample_from_wire(s))
                 for rid, token, pos, pages, s in decode],
            )
            for prefill, decode in ranks
        ],
    )  # fmt: skip


def result_to_wire(result: RankResult) -> list:
    return [result.step_id, result.prefill_tokens, result.decode_tokens, result.prefill_error,
            result.decode_error]  # fmt: skip


def result_from_wire(wire: list) -> RankResult:
    return RankResult(*wire)


def encode_plan(plan: StepPlan) -> bytes:
    return msgpack.packb(plan_to_wire(plan), use_bin_type=True)


def decode_plan(data: bytes) -> StepPlan:
    return plan_from_wire(msgpack.unpackb(data, raw=False))


def encode_result(result: RankResult) -> bytes:
    return msgpack.packb(result_to_wire(result), use_bin_type=True)


def decode_result(data: bytes) -> RankResult:
    return result_from_wire(msgpack.unpackb(data, raw=False))
