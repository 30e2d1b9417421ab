"""Chunked-prefill planning shared by the prefill worker and the decode worker's local prefill. Pure Python."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def plan_prefill_chunks(
    pending: Iterable[tuple[Hashable, int, int]],
    token_budget: int,
    max_chunk: int,
    fixed_chunks: bool = False,
) -> list[tuple[Hashable, int, int]]:
    """pending: (key, num_computed_tokens, num_tokens) in priority order. Returns (key, start, length) chunks,
    first come first served, at most `max_chunk` tokens per request and `token_budget` in all.

    fixed_chunks (batch-invariant mode): a prompt is cut only every min(max_chunk, token_budget)
    tokens, never where the step's budget ran out, so its chunks (and their arithmetic) do not depend
    on the prompts it shares steps with; a chunk that does not fit waits for the next step."""
    plan = []
    budget = token_budget
    chunk_cap = min(max_chunk, token_budget) if fixed_chunks else max_chunk
    for key, computed, total in pending:
        if budget <= 0:
            break
        length = min(total - computed, chunk_cap, budget)
        if fixed_chunks and length < min(total - computed, chunk_cap):
            break
        if length > 0:
            plan.append((key, computed, length))
            budget -= length
    return plan
