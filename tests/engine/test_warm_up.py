"""Warm-up plans: every prompt size and decode graph bucket a worker will run, on every rank alike, within the
worker's pages and context."""

from __future__ import annotations

from pdserve.engine.cuda_graphs import BATCH_BUCKETS
from pdserve.engine.warm_up import PREFILL_SIZES, page_buckets, warm_up_plans


def test_page_buckets_cover_the_context():
    assert page_buckets(1, 64) == [16]
    assert page_buckets(1024, 64) == [16]
    assert page_buckets(1025, 64) == [16, 32]
    assert page_buckets(8192, 64) == [16, 32, 64, 128]


def test_plans_run_every_bucket_on_every_rank():
    plans = warm_up_plans(
        2, page_size=64, num_pages=1000, prefill_tokens=2048, decode_rows=64, decode_tokens=4096
    )
    prefill = [p for p in plans if p.ranks[0].prefill]
    decode = [p for p in plans if p.ranks[0].decode]
    assert len(prefill) + len(decode) == len(plans)
    assert [len(p.ranks[0].prefill[0].token_ids) for p in prefill] == [*PREFILL_SIZES, 2048]
    batches = [b for b in BATCH_BUCKETS if b <= 64]
    keys = [(len(p.ranks[0].decode), len(p.ranks[0].decode[0].page_ids)) for p in decode]
    assert keys == [(b, w) for w in (16, 32, 64) for b in batches]
    for p in plans:
        assert len(p.ranks) == 2 and p.ranks[0] == p.ranks[1]
        for row in p.ranks[0].decode:
            assert row.position < 4096 and row.position < len(row.page_ids) * 64
        for row in p.ranks[0].prefill:
            assert max(row.page_ids) < 1000
    assert len({p.step_id for p in plans}) == len(plans)


def test_plans_stay_within_the_pages_and_skip_decode_without_graphs():
    plans = warm_up_plans(1, 16, num_pages=2, prefill_tokens=64, decode_rows=0, decode_tokens=4096)
    assert [len(p.ranks[0].prefill[0].token_ids) for p in plans] == [1, 7, 16]  # 64 needs 4 pages
    assert warm_up_plans(1, 16, 8, 16, decode_rows=8, decode_tokens=0)[-1].ranks[0].prefill


def test_a_token_budget_adds_batched_prompts_the_budget_and_a_later_chunk():
    plans = warm_up_plans(
        1, page_size=64, num_pages=1000, prefill_tokens=2048, decode_rows=0, decode_tokens=0,
        prefill_budget=5000,
    )  # fmt: skip
    shapes = [[(len(r.token_ids), r.start) for r in p.ranks[0].prefill] for p in plans]
    singles = [[(n, 0)] for n in (*PREFILL_SIZES, 2048)]
    batched = []
    for b in BATCH_BUCKETS:
        if 1 < b <= 5000 // 16:
            batched += [[(16, 0)] * b, [(16, 0)] * (b - 1) + [(15, 0)]]
    budget = [[(2048, 0), (2048, 0), (904, 0)], [(2048, 0), (2048, 0), (903, 0)]]
    later = [[(2048, 2048)], [(2047, 2048)]]
    assert shapes == [*singles, *batched, *budget, *later]
    for p in plans:
        for row in p.ranks[0].prefill:
            assert max(row.page_ids) < 1000
            assert len(row.page_ids) * 64 >= row.start + len(row.token_ids)


def test_a_speculating_worker_warms_up_verify_groups_greedy_and_sampled():
    plans = warm_up_plans(1, 64, 100, 64, 64, 4096, num_drafts=3)
    assert all(p.mtp and p.num_drafts == 3 for p in plans)
    groups = [p.ranks[0].decode for p in plans if any(r.drafts for r in p.ranks[0].decode)]
    # request buckets whose rows with 3 drafts each fit 64 rows, at each page width, greedy and sampled
    requests = [b for b in BATCH_BUCKETS if 4 * b <= 64]
    assert sorted({len(rows) // 4 for rows in groups}) == requests
    assert len(groups) == 2 * len(requests) * len(page_buckets(4096, 64))
    for rows in groups:
        width = len(rows[0].page_ids)
        for first in rows[::4]:
            assert first.drafts == 3
            # the drafts' rows and the chain's positions stay inside the page table
            assert first.position + 2 * 3 < width * 64
        assert {r.sample.temperature for r in rows} in ({0.0}, {1.0})
    assert warm_up_plans(1, 64, 100, 64, 64, 4096)[0].mtp is False
