"""Speculative decoding's arithmetic: drafting tokens from the MTP module's logits, and verifying a request's
drafts against the target's logits of its verify group (`DecodeRow.drafts`).

A request's verify group is its last token and its drafts d_1..d_k as rows at consecutive positions: row i's
logits give the target's distribution for the token after d_i (row 0: after the last token). Acceptance keeps
the longest prefix of drafts the rule accepts and one token more:
- greedy rows: d_{i+1} is accepted while it equals row i's argmax, and the token after the prefix is that
  argmax: exactly the tokens one token a step would give (in batch-invariant mode, to the bit);
- sampled rows: the speculative-sampling rule. d_{i+1} drawn from q_i is accepted with probability
  min(1, p_i(d) / q_i(d)), p_i the target's distribution after the request's penalties, bans, temperature,
  top-k, top-p and min-p; at the first rejection the token is drawn from max(0, p_i - q_i) renormalized, and
  when every draft is accepted the last row's token is drawn from p_k as plain sampling draws it. The tokens
  then follow the target's distribution whatever q is. A draft whose q is not known here (proposed elsewhere)
  is taken as drawn from the point mass on it, for which the rule is accept with probability p_i(d), else
  draw from p_i without d: the same guarantee.

Every draw depends only on the request's seed and the step of the token it decides (as plain sampling's), each
kind (draft, acceptance, residual) from its own stream, so a request's tokens never depend on its batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampler import PenaltyCounts, ban, sample_tokens, token_logprobs
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.engine.step import MAX_DRAFTS, NO_LOGPROBS, DecodeRow, SampleSpec

if TYPE_CHECKING:
    from pdserve.engine.grammar_masks import RowMasks
from pdserve.kernels.sampling.ref import (
    kept_distribution,
    race,
    sample_with_distribution,
    uniform_noise,
)

DRAFT_STREAM = 0x2545F4914F6CDD1D
_ACCEPT_STREAM = 0x1B87359385EBCA6B
"""XORed into a request's seed: the draft and acceptance draws' noise streams, apart from the sampling one."""

__all__ = [
    "DRAFT_STREAM",
    "MAX_DRAFTS",
    "DraftProbs",
    "Verified",
    "draft_tokens",
    "verify",
    "verify_groups",
]


def _col(values, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _fields(specs: Sequence[SampleSpec], device) -> tuple[torch.Tensor, ...]:
    """The rows' temperature, top_k, top_p and min_p as columns on `device`."""
    return (
        _col([s.temperature for s in specs], torch.float32, device),
        _col([s.top_k for s in specs], torch.int32, device),
        _col([s.top_p for s in specs], torch.float32, device),
        _col([s.min_p for s in specs], torch.float32, device),
    )


def _kept(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """Each row's sampling distribution [N, V] fp32 (kept probabilities, renormalized)."""
    return kept_distribution(logits, *_fields(specs, logits.device))


def draft_tokens(
    logits: torch.Tensor, specs: Sequence[SampleSpec], steps: Sequence[int]
) -> tuple[list[int], torch.Tensor | None]:
    """Drafts one token per row from the MTP module's logits [N, V]: greedy rows (temperature 0) take the
    argmax; sampled rows draw from the distribution the row's sampling fields make of them (no penalties),
    with the draft stream's noise of (seed, `steps[i]`, the step of the token it proposes). Returns the
    tokens and the draft distributions q [N, V] (rows of greedy requests unused), None when every row is
    greedy."""
    if all(s.temperature <= 0 for s in specs):
        return logits.argmax(-1).tolist(), None
    device = logits.device
    seeds = _col([(s.seed ^ DRAFT_STREAM) for s in specs], torch.int64, device)
    drafts, q = sample_with_distribution(
        logits, *_fields(specs, device), seeds, _col(list(steps), torch.int64, device)
    )
    return drafts.tolist(), q


class DraftProbs:
    """The draft distributions of the drafts a runner proposed last step, per request, so that the next step
    verifies them with their q: [k, V] fp32 (row j: draft j + 1's), kept for sampled requests only. As with
    `PenaltyCounts`, a request missing from a step's rows is gone from this runner (`keep`)."""

    def __init__(self) -> None:
        self._probs: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._probs)

    def put(self, request_id: str, probs: torch.Tensor | None) -> None:
        if probs is None:
            self._probs.pop(request_id, None)
        else:
            self._probs[request_id] = probs

    def get(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """The request's q for its `num_drafts` drafts, or None when not known here (or not as many)."""
        probs = self._probs.get(request_id)
        if probs is None or probs.shape[0] < num_drafts:
            return None
        return probs[:num_drafts]

    def keep(self, request_ids: set[str]) -> None:
        for request_id in [r for r in self._probs if r not in request_ids]:
            del self._probs[request_id]


@dataclasses.dataclass(frozen=True, slots=True)
class Verified:
    tokens: list[int]
    """Per row: a plain or replay row's sampled token; in a verify group, row i's is the group's i-th kept
    token for i < `accepted` of the group (else the target's token there, meaningless)."""
    accepted: list[int]
    """Per row: tokens a group keeps on its first row, 0 on its other rows, 1 on any other row."""
    logprobs: list[TokenLogprobs | None] | None
    """Per row, where any row asks for log-probabilities: those of its token (from the raw logits)."""
    group_of: list[int]
    """Per row: the first row of its verify group, -1 for a row in none."""


def verify(
    logits: torch.Tensor,
    rows: Sequence[DecodeRow],
    counts: PenaltyCounts,
    draft_probs: DraftProbs | None = None,
    relaxed: tuple[int, float] | None = None,
    masks: RowMasks | None = None,
) -> Verified:
    """Samples the plain rows and verifies the verify groups of a decode pass. logits: [R, V] the target's raw
    logits of `rows`; counts: the runner's penalty counts (a group's rows see its earlier drafts counted; the
    kept tokens are counted in); draft_probs: the q of drafts this runner proposed (sampled requests);
    relaxed: (top-k, delta) of relaxed acceptance for greedy rows marked `SampleSpec.relaxed`: a draft among
    the row's top-k tokens within delta of its best log-probability (of the penalized logits) is accepted as
    if it were the argmax; a rejected one is replaced by the argmax (no longer the tokens of one token a
    step: opt-in, inside think blocks); masks: the constrained rows' allowed tokens (structured outputs; a verify
    group's row i masked as if its drafts up to i were taken), applied after the penalties and bans, so a
    draft the grammar refuses is never accepted."""
    specs = [r.sample for r in rows]
    group_of, starts = verify_groups(rows)
    adjusted = _adjusted(logits, rows, group_of, counts)
    if masks is not None:
        adjusted = masks.apply(adjusted)
    target = sample_tokens(adjusted, specs, [s.step for s in specs])
    tokens, accepted = list(target), [1 if g < 0 else 0 for g in group_of]
    sampled_groups = [s for s in starts if specs[s].temperature > 0]
    loose = _relaxed_rows(adjusted, rows, specs, starts, relaxed)
    for s in starts:
        if specs[s].temperature <= 0:
            k, a = rows[s].drafts, 0
            while a < k and (
                rows[s + a + 1].token_id == target[s + a]
                or rows[s + a + 1].token_id in loose.get(s + a, ())
            ):
                a += 1
            for i in range(a):
                tokens[s + i] = rows[s + i + 1].token_id
            accepted[s] = a + 1  # tokens[s + a] is the target's own
    if sampled_groups:
        _verify_sampled(adjusted, rows, specs, sampled_groups, draft_probs, tokens, accepted)
    for s in starts:
        penalized = specs[s].penalized
        for i in range(accepted[s] if penalized else 0):
            counts.sampled(rows[s].request_id, tokens[s + i])
    for r, g in enumerate(group_of):
        if g < 0 and specs[r].penalized:
            counts.sampled(rows[r].request_id, tokens[r])
    logprobs = None
    if any(s.logprobs != NO_LOGPROBS for s in specs):
        logprobs = token_logprobs(logits, tokens, specs)
    return Verified(tokens, accepted, logprobs, group_of)


def _relaxed_rows(
    adjusted: torch.Tensor, rows: Sequence[DecodeRow], specs: Sequence[SampleSpec],
    starts: list[int], relaxed: tuple[int, float] | None,
) -> dict[int, set[int]]:  # fmt: skip
    """Per greedy group row marked relaxed (that judges a draft): the tokens relaxed acceptance takes there."""
    if relaxed is None or relaxed[0] <= 0:
        return {}
    judged = [
        s + i for s in starts if specs[s].temperature <= 0 for i in range(rows[s].drafts)
        if specs[s + i].relaxed
    ]  # fmt: skip
    if not judged:
        return {}
    topk, delta = relaxed
    logp = torch.log_softmax(adjusted[judged].float(), dim=-1)  # [J, V]
    values, ids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    ok = values >= values[:, :1] - delta
    return {
        r: {t for t, good in zip(row_ids, row_ok, strict=True) if good}
        for r, row_ids, row_ok in zip(judged, ids.tolist(), ok.tolist(), strict=True)
    }


def verify_groups(rows: Sequence[DecodeRow]) -> tuple[list[int], list[int]]:
    """(per row the first row of its verify group or -1, the groups' first rows). Raises ValueError for a
    group that runs past its request's rows."""
    n = len(rows)
    group_of = [-1] * n
    starts: list[int] = []
    r = 0
    while r < n:
        k = rows[r].drafts
        if k:
            if r + k >= n or any(
                rows[r + i].request_id != rows[r].request_id for i in range(k + 1)
            ):
                raise ValueError(
                    f"row {r}: a verify group of {k} drafts runs past its request's rows"
                )
            starts.append(r)
            for i in range(k + 1):
                group_of[r + i] = r
            r += k + 1
        else:
            r += 1
    return group_of, starts


def _adjusted(
    logits: torch.Tensor, rows: Sequence[DecodeRow], group_of: list[int], counts: PenaltyCounts
) -> torch.Tensor:
    """The logits with each row's penalties and bans applied: a verify group's row i counts its request's
    drafts d_1..d_i as generated before it."""
    penalized = [i for i, r in enumerate(rows) if r.sample.penalized]
    banned = [i for i, r in enumerate(rows) if r.sample.banned_ids]
    if not penalized and not banned:
        return logits
    adjusted = logits.float().clone()
    for i in penalized:
        g = group_of[i]
        ahead = [rows[j].token_id for j in range(g + 1, i + 1)] if g >= 0 else []
        adjusted[i] = counts.penalize(rows[i].request_id, rows[i].sample, logits[i], ahead)
    for i in banned:
        adjusted[i] = ban(adjusted[i], rows[i].sample.banned_ids)
    return adjusted


def _verify_sampled(
    adjusted: torch.Tensor,
    rows: Sequence[DecodeRow],
    specs: Sequence[SampleSpec],
    starts: list[int],
    draft_probs: DraftProbs | None,
    tokens: list[int],
    accepted: list[int],
) -> None:
    """The speculative-sampling rule over the sampled groups starting at `starts`, writing their `tokens` and
    `accepted` (their last rows' tokens, plain draws from p_k, are in `tokens` already)."""
    device = adjusted.device
    checked = [
        s + i for s in starts for i in range(rows[s].drafts)
    ]  # rows whose next draft is judged
    drafts = [rows[r + 1].token_id for r in checked]
    p = _kept(adjusted[checked], [specs[r] for r in checked])  # [C, V]
    q_rows: list[torch.Tensor] = []
    for s in starts:
        k = rows[s].drafts
        q = None if draft_probs is None else draft_probs.get(rows[s].request_id, k)
        if q is None:  # the point mass on each draft
            d = _col([rows[s + i + 1].token_id for i in range(k)], torch.int64, device)
            q = torch.zeros(k, p.shape[1], device=device).scatter_(1, d[:, None], 1.0)
        q_rows.append(q)
    q = torch.cat(q_rows).to(p.dtype)  # [C, V]
    d = _col(drafts, torch.int64, device)[:, None]
    p_d, q_d = p.gather(1, d)[:, 0], q.gather(1, d)[:, 0]
    seeds = _col([specs[r].seed ^ _ACCEPT_STREAM for r in checked], torch.int64, device)
    steps = _col([specs[r].step for r in checked], torch.int64, device)
    u = uniform_noise(seeds, steps, 1)[:, 0]
    # accept when u < p/q (q(d) > 0: d was drawn from q)
    ok = (u * q_d < p_d).tolist()
    rejected: list[int] = []  # rows of `checked` where a group stops
    at = 0
    for s in starts:
        k, a = rows[s].drafts, 0
        while a < k and ok[at + a]:
            tokens[s + a] = drafts[at + a]
            a += 1
        if a < k:
            rejected.append(at + a)
        accepted[s] = a + 1
        at += k
    if rejected:
        residual = (p[rejected] - q[rejected]).clamp_min(0.0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q: any draw from p is the rule's
        residual = torch.where(empty, p[rejected], residual)
        seeds = _col([specs[checked[c]].seed for c in rejected], torch.int64, device)
        steps = _col([specs[checked[c]].step for c in rejected], torch.int64, device)
        for c, token in zip(rejected, race(residual, seeds, steps).tolist(), strict=True):
            tokens[checked[c]] = token
