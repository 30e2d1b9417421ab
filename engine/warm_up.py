"""A worker's warm-up before it serves: step plans of made-up rows that run every shape the worker will run, so
that Triton compiles its kernels and each decode CUDA-graph bucket is captured now, not in a client's request.

The plans go through the worker's ordinary step path (`Worker.warm_up`), on every rank of a worker of several
ranks at once, so the ranks capture the same buckets in the same order (a capture runs the pass's collectives).
The rows read and write pages no request owns yet (a worker warms up before it admits any) and their tokens are
dropped. Pure Python (no torch)."""

from __future__ import annotations

from pdserve.engine.cuda_graphs import BATCH_BUCKETS
from pdserve.engine.pages import pages_needed
from pdserve.engine.step import DecodeRow, PrefillRow, RankStep, SampleSpec, StepPlan

__all__ = ["PREFILL_SIZES", "page_buckets", "warm_up_plans"]

PREFILL_SIZES = (1, 7, 16)
"""Prompt chunk lengths a prefill warm-up runs besides the largest (Triton specializes integer arguments on
being 1 and on divisibility by 16)."""

_GREEDY = SampleSpec(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
_SAMPLED = SampleSpec(temperature=1.0, top_p=0.9, top_k=-1, min_p=0.0, seed=0, step=0)


def page_buckets(max_tokens: int, page_size: int) -> list[int]:
    """The page-table widths of decode graph buckets (`DecodeGraphs.key`: powers of two from 16) that
    sequences of up to `max_tokens` tokens use."""
    need = pages_needed(max(max_tokens, 1), page_size)
    out, width = [], 16
    while True:
        out.append(width)
        if width >= need:
            return out
        width *= 2


def warm_up_plans(
    num_ranks: int, page_size: int, num_pages: int, prefill_tokens: int, decode_rows: int,
    decode_tokens: int, prefill_budget: int | None = None, num_drafts: int = 0,
) -> list[StepPlan]:  # fmt: skip
    """Plans for a worker of `num_ranks` ranks (every rank the same rows: as many as the busiest rank of a
    data-parallel worker runs, or the rows of a tensor-parallel one): prefill passes of one prompt of
    `PREFILL_SIZES` and `prefill_tokens` tokens per rank; with `prefill_budget` (prompt tokens a step may
    batch) passes of several prompts, 16 tokens each, one per batch bucket of rows (the head's rows and the
    sampler's batch are the prompts; kernels specialize on their power-of-two class), a pass filling the
    budget with prompt chunks and a chunk that continues a prompt; then (decode_rows > 0) one decode pass per
    graph bucket of up to `decode_rows` rows per rank and page tables for up to `decode_tokens` tokens. Page
    ids stay below `num_pages`; rows of one pass may share pages (their KV is never read). num_drafts > 0 (a
    worker that speculates): every plan runs the MTP module's passes and drafts, and for each graph bucket of
    requests whose rows with `num_drafts` drafts each fit `decode_rows`, a pass verifying them, greedy and
    sampled (the verify bucket's decode graph and its draft graphs)."""
    plans: list[StepPlan] = []

    def plan(step: RankStep) -> None:
        plans.append(StepPlan(-1 - len(plans), [step] * num_ranks, num_drafts > 0, num_drafts))

    for n in sorted({*PREFILL_SIZES, prefill_tokens}):
        if n > prefill_tokens or pages_needed(n, page_size) > num_pages:
            continue
        pages = list(range(pages_needed(n, page_size)))
        plan(RankStep(prefill=[PrefillRow("warm-up", [0] * n, 0, pages, _GREEDY)]))
    if prefill_budget:
        _batched_prefill(plan, page_size, num_pages, prefill_tokens, prefill_budget)
    if decode_rows <= 0 or decode_tokens <= 0:
        return plans
    batches = [b for b in BATCH_BUCKETS if b <= decode_rows]
    for width in page_buckets(min(decode_tokens, num_pages * page_size), page_size):
        for b in batches:
            # every row attends over the whole width (the most work its bucket runs), writing page 0
            position = min(width * page_size, decode_tokens) - 1
            rows = [DecodeRow(f"warm-up-{i}", 0, position, [0] * width, _GREEDY) for i in range(b)]
            plan(RankStep(decode=rows))
        if not num_drafts:
            continue
        # verify groups: the rows and their drafts', then the chain's positions, inside the width
        position = min(width * page_size, decode_tokens) - 1 - 2 * num_drafts
        for b in batches:
            if b * (num_drafts + 1) > decode_rows or position < 0:
                continue
            for spec in (_GREEDY, _SAMPLED):
                rows = [
                    DecodeRow(f"warm-up-{i}", 0, position + j, [0] * width, spec,
                              num_drafts if j == 0 else 0)
                    for i in range(b) for j in range(num_drafts + 1)
                ]  # fmt: skip
                plan(RankStep(decode=rows))
    return plans


def _batched_prefill(plan, page_size: int, num_pages: int, chunk: int, budget: int) -> None:
    """Prefill passes of several prompts (see `warm_up_plans`), each twice: with a multiple of 16 tokens in
    all and with one token fewer (kernels specialize on an integer's divisibility by 16, and the MoE's
    launches on the tokens an expert gets)."""

    def rows_of(sizes: list[int], start: int = 0) -> None:
        for cut in (0, 1):
            lengths = sizes[:-1] + [sizes[-1] - cut]
            pages = list(range(pages_needed(start + max(lengths), page_size)))
            plan(RankStep(prefill=[
                PrefillRow(f"warm-up-{i}", [0] * n, start, pages, _GREEDY)
                for i, n in enumerate(lengths)
            ]))  # fmt: skip

    short = 16
    if pages_needed(short, page_size) <= num_pages:
        for rows in BATCH_BUCKETS:
            if rows > 1 and rows * short <= budget:
                rows_of([short] * rows)
    chunk = min(chunk, budget)
    if pages_needed(chunk, page_size) <= num_pages:
        rows_of([chunk] * (budget // chunk) + ([budget % chunk] if budget % chunk > 1 else []))
    if (
        pages_needed(2 * chunk, page_size) <= num_pages
    ):  # a prompt's second chunk: attends to its first
        rows_of([chunk], start=chunk)
