"""Chunked-prefill planning shared by the prefill worker and the decode worker's local prefill. Pure Python."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def plan_prefill_chunks(
    pending: Iterable[tuple[Hashable, int, int]], token_budget: int, max_chunk: int
) -> list[tuple[Hashable, int, int]]:
    """pending: (key, num_computed_tokens, num_tokens) in priority order. Returns (key, start, length) chunks,
    first come first served, at most `max_chunk` tokens per request and `token_budget` in all."""
    plan = []
    budget = token_budget
    for key, computed, total in pending:
        if budget <= 0:
            break
        length = min(total - computed, max_chunk, budget)
        if length > 0:
            plan.append((key, computed, length))
            budget -= length
    return plan
