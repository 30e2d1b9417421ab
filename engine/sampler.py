"""Samples one token per request from a batch of logits with each request's own parameters: penalties and bans
on the logits first, then the sampling kernel, and the log-probabilities of the raw logits for the rows that ask.

Every step here works row by row, so a request's token and log-probabilities never depend on its batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve import kernels

from .sampling_params import SamplingParams, TokenLogprobs
from .step import NO_LOGPROBS, SampleSpec


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


def penalize(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """One row's logits [V] with `spec`'s penalties and bans applied (a new fp32 tensor): the repetition penalty
    (Hugging Face's: positive logits divided by it, negative ones multiplied, over every token of
    `penalty_ids`), then the frequency and presence penalties (OpenAI's: minus frequency x count and presence x
    [count > 0], over the generated tokens, the last `step` of `penalty_ids`), then banned tokens at -inf."""
    out = logits.float().clone()
    ids = torch.tensor(spec.penalty_ids, dtype=torch.long).to(out.device, non_blocking=True)
    if spec.repetition_penalty != 1 and len(spec.penalty_ids):
        seen = torch.zeros_like(out, dtype=torch.bool).index_fill_(0, ids, True)
        r = spec.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if (spec.frequency_penalty or spec.presence_penalty) and spec.step:
        generated = ids[max(0, len(spec.penalty_ids) - spec.step) :]
        ones = torch.ones_like(generated, dtype=out.dtype)
        counts = torch.zeros_like(out).index_add_(0, generated, ones)  # [V]
        out = out - spec.frequency_penalty * counts - spec.presence_penalty * (counts > 0).float()
    if spec.banned_ids:
        banned = torch.tensor(spec.banned_ids, dtype=torch.long).to(out.device, non_blocking=True)
        out = out.index_fill(0, banned, float("-inf"))
    return out


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


def sample(
    logits: torch.Tensor, specs: Sequence[SampleSpec]
) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """logits: [B, V], the model's raw logits. Returns each row's token and, when any row asks for them, each
    row's `token_logprobs` (None otherwise)."""
    if all(s.plain for s in specs):
        return sample_tokens(logits, specs, [s.step for s in specs]), None
    rows = [i for i, s in enumerate(specs) if not s.plain and _changes_logits(s)]
    penalized = logits
    if rows:
        penalized = logits.float().clone()
        for i in rows:
            penalized[i] = penalize(logits[i], specs[i])
    tokens = sample_tokens(penalized, specs, [s.step for s in specs])
    if all(s.logprobs == NO_LOGPROBS for s in specs):
        return tokens, None
    return tokens, token_logprobs(logits, tokens, specs)


def _changes_logits(spec: SampleSpec) -> bool:
    return bool(spec.penalty_ids or spec.banned_ids) and (
        spec.repetition_penalty != 1
        or spec.frequency_penalty != 0
        or spec.presence_penalty != 0
        or bool(spec.banned_ids)
    )
