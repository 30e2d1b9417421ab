"""Samples one token per request from a batch of logits with each request's own parameters: penalties and bans
on the logits first, then the sampling kernel, and the log-probabilities of the raw logits for the rows that ask.

Every step here works row by row, so a request's token and log-probabilities never depend on its batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from pdserve import kernels
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.step import NO_LOGPROBS, SampleSpec

if TYPE_CHECKING:
    from pdserve.engine.grammar_masks import RowMasks

SPAN_SAMPLING = "pdserve.sampling"
"""torch.profiler range of `sample` (`engine.step_profile` counts the kernels under it): penalties, bans,
masks, the sampling kernel, the log-probabilities and the tokens' copy to the host."""


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams | SampleSpec], steps: Sequence[int]
) -> list[int]:
    """logits: [B, V]; params[b].seed must be set (see SamplingParams.with_seed); steps[b]: tokens request b has
    generated so far. The draw depends only on (seed, step), never on the batch."""
    device = logits.device

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    if all(p.temperature <= 0 for p in params):
        return logits.argmax(-1).tolist()
    ids = kernels.sample(
        logits,
        col([p.temperature for p in params], torch.float32),
        col([p.top_k for p in params], torch.int32),
        col([p.top_p for p in params], torch.float32),
        col([p.min_p for p in params], torch.float32),
        col([p.seed or 0 for p in params], torch.int64),
        col(list(steps), torch.int64),
    )
    return ids.tolist()


class PenaltyCounts:
    """What the penalties count for each penalized request a runner samples, kept from step to step: the tokens
    it has generated ([V] counts) and, with a repetition penalty, every token of its sequence ([V] flags). A
    request's counts start from the sequence its row carries (`SampleSpec.penalty_ids`) and go on with each
    token sampled for it here. The scheduler plans every running request every step, so a request missing
    from a step's rows is gone from this runner (finished, aborted or preempted): `keep` drops its counts, and
    a request that comes back carries its sequence again."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def penalize(
        self, request_id: str, spec: SampleSpec, logits: torch.Tensor, ahead: Sequence[int] = ()
    ) -> torch.Tensor:
        """One row's logits [V] with the request's penalties applied (a new fp32 tensor): the repetition
        penalty (Hugging Face's: positive logits divided by it, negative ones multiplied, over every token of
        the sequence), then the frequency and presence penalties (OpenAI's: minus frequency x count and presence
        x [count > 0], over the generated tokens). ahead: tokens counted as generated after the counted ones
        for this row alone (a verify group's drafts before the row). Raises RuntimeError for a request whose
        counts were never given here (the pass fails, and with it the request)."""
        out = logits.float().clone()
        if spec.penalty_ids is not None:
            self._start(request_id, spec, out)
        state = self._counts.get(request_id)
        if state is None:
            raise RuntimeError(f"request {request_id}: no penalty counts on this runner")
        counts, seen = state  # [V], [V] or None
        if ahead:
            ids = torch.tensor(list(ahead), dtype=torch.long).to(out.device, non_blocking=True)
            counts = counts.index_add(0, ids, torch.ones_like(ids, dtype=counts.dtype))
            if seen is not None:
                seen = seen.index_fill(0, ids, True)
        if seen is not None:
            r = spec.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        return out - spec.frequency_penalty * counts - spec.presence_penalty * (counts > 0).float()

    def sampled(self, request_id: str, token: int) -> None:
        """Counts the token just sampled for a request with counts here."""
        state = self._counts.get(request_id)
        if state is not None:
            counts, seen = state
            counts[token] += 1
            if seen is not None:
                seen[token] = True

    def keep(self, request_ids: set[str]) -> None:
        """Drops the counts of every request not in `request_ids` (a step's rows)."""
        for request_id in [r for r in self._counts if r not in request_ids]:
            del self._counts[request_id]

    def _start(self, request_id: str, spec: SampleSpec, like: torch.Tensor) -> None:
        ids = torch.tensor(spec.penalty_ids, dtype=torch.long).to(like.device, non_blocking=True)
        generated = ids[max(0, len(spec.penalty_ids) - spec.step) :]
        counts = torch.zeros_like(like).index_add_(
            0, generated, torch.ones_like(generated, dtype=like.dtype)
        )
        seen = None
        if spec.repetition_penalty != 1:
            seen = torch.zeros_like(like, dtype=torch.bool).index_fill_(0, ids, True)
        self._counts[request_id] = (counts, seen)


def ban(logits: torch.Tensor, banned_ids: Sequence[int]) -> torch.Tensor:
    """One row's logits [V] with `banned_ids` at -inf."""
    banned = torch.tensor(banned_ids, dtype=torch.long).to(logits.device, non_blocking=True)
    return logits.index_fill(0, banned, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], specs: Sequence[SampleSpec]
) -> list[TokenLogprobs | None]:
    """Per row, None unless its spec asks for log-probabilities: the sampled token's log-probability and the
    `spec.logprobs` most likely tokens', from the log-softmax of the raw logits [B, V] in fp32."""
    out: list[TokenLogprobs | None] = [None] * len(specs)
    rows = [i for i, s in enumerate(specs) if s.logprobs != NO_LOGPROBS]
    if not rows:
        return out
    for i in rows:  # one row at a time: a row's figures never depend on its batch
        logprobs = torch.log_softmax(logits[i].float(), dim=-1)  # [V]
        k = min(specs[i].logprobs, logprobs.numel())
        top = torch.topk(logprobs, k) if k else None
        out[i] = TokenLogprobs(
            float(logprobs[tokens[i]]),
            tuple(top.indices.tolist()) if top is not None else (),
            tuple(top.values.tolist()) if top is not None else (),
        )
    return out


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [N, V], from the log-softmax of the raw logits in fp32: the log-probability of
    targets[row] ([N] int64 on the logits' device) and its rank (1: the most likely; ties share the best), and
    the k most likely tokens' ids and log-probabilities ([N, k]), on the device (prompt log-probabilities: row
    i scores the prompt token after it; `to_token_logprobs` makes them objects)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logprobs.gather(1, targets[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(1) + 1
    if not k:
        none = torch.empty(logprobs.shape[0], 0, dtype=torch.long, device=logprobs.device)
        return chosen[:, 0], ranks, none, none.float()
    top = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
    return chosen[:, 0], ranks, top.indices, top.values


def to_token_logprobs(
    chosen: torch.Tensor, ranks: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor
) -> list[TokenLogprobs]:
    """`target_logprobs`' tensors (blocks of them concatenated) as one `TokenLogprobs` per row."""
    ids, values = top_ids.tolist(), top_values.tolist()
    return [
        TokenLogprobs(c, tuple(i), tuple(v), r)
        for c, i, v, r in zip(chosen.tolist(), ids, values, ranks.tolist(), strict=True)
    ]


def sample(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    request_ids: Sequence[str] = (),
    counts: PenaltyCounts | None = None,
    masks: RowMasks | None = None,
) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """logits: [B, V], the model's raw logits; request_ids: each row's request, and counts: the runner's
    `PenaltyCounts` (the sampled tokens are counted in; without it, penalized rows must carry their sequence
    and nothing is kept); masks: the constrained rows' allowed tokens (structured outputs), applied after
    the penalties and bans. Returns each row's token and, when any row asks for them, each row's
    `token_logprobs` (None otherwise; of the raw logits, before any mask)."""
    with record_function(SPAN_SAMPLING):
        return _sample(logits, specs, request_ids, counts, masks)


def _sample(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    request_ids: Sequence[str],
    counts: PenaltyCounts | None,
    masks: RowMasks | None,
) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    if all(s.plain for s in specs):
        return sample_tokens(logits, specs, [s.step for s in specs]), None
    penalized = [i for i, s in enumerate(specs) if s.penalized]
    banned = [i for i, s in enumerate(specs) if s.banned_ids]
    if penalized and counts is None:  # counted for this call alone: every row carries its sequence
        counts, request_ids = PenaltyCounts(), [str(i) for i in range(len(specs))]
    adjusted = logits
    if penalized or banned:
        adjusted = logits.float().clone()
        for i in penalized:
            adjusted[i] = counts.penalize(request_ids[i], specs[i], logits[i])
        for i in banned:
            adjusted[i] = ban(adjusted[i], specs[i].banned_ids)
    if masks is not None:
        adjusted = masks.apply(adjusted)
    tokens = sample_tokens(adjusted, specs, [s.step for s in specs])
    for i in penalized:
        counts.sampled(request_ids[i], tokens[i])
    if all(s.logprobs == NO_LOGPROBS for s in specs):
        return tokens, None
    return tokens, token_logprobs(logits, tokens, specs)
