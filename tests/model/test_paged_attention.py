"""Absorbed MLA decode over the paged latent cache equals the naive form (fp32, <= 1e-5 relative), for page sizes
1, 16 and 64 and a ragged batch; chunked prefill over a cached prefix equals one-shot prefill, the prefix attended
whole or in blocks; the blocks cut each request's prefix at fixed positions and bound each launch's keys."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import batch as batch_module
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

LENGTHS = [1, 7, 33, 70, 130]


def scattered_pages(lengths, page_size, extra=3, seed=0):
    """Page lists per request, drawn at random from one shared pool (pages of a request are not contiguous)."""
    need = [-(-(n + extra) // page_size) for n in lengths]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(perm[start : start + n])
        start += n
    return pages, sum(need)


def run(model, chunks, page_size, cache, decode, all_logits=False):
    batch = build_forward_batch(chunks, page_size, "cpu", decode=decode, all_logits=all_logits)
    return model.compute_logits(model(batch, cache)[batch.logits_indices])


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint("tiny-fp32"), dtype=torch.float32)


def new_cache(model, page_size, num_pages):
    layout = KVCacheLayout.for_model(model.args, page_size, torch.float32, model.num_mtp)
    return PagedKVCache(layout, num_pages, "cpu")


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_absorbed_decode_equals_naive(model, page_size, num_queries):
    g = torch.Generator().manual_seed(page_size)
    seqs = [torch.randint(3, model.args.vocab_size, (n + num_queries,), generator=g).tolist()
            for n in LENGTHS]  # fmt: skip
    pages, num_pages = scattered_pages([len(s) for s in seqs], page_size)
    # Naive: the whole sequence in one prefill batch; logits of its last num_queries tokens.
    cache = new_cache(model, page_size, num_pages)
    naive = run(
        model,
        [SeqChunk(s, 0, p) for s, p in zip(seqs, pages, strict=True)],
        page_size,
        cache,
        False,
        True,
    )
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    naive_last = torch.cat([naive[cu[i + 1] - num_queries : cu[i + 1]] for i in range(len(seqs))])
    # Absorbed: prefill all but the last num_queries tokens, then one decode step with num_queries each.
    cache = new_cache(model, page_size, num_pages)
    run(
        model,
        [SeqChunk(s[:-num_queries], 0, p) for s, p in zip(seqs, pages, strict=True)],
        page_size,
        cache,
        False,
    )
    decode_chunks = [
        SeqChunk(s[-num_queries:], len(s) - num_queries, p)
        for s, p in zip(seqs, pages, strict=True)
    ]
    absorbed = run(model, decode_chunks, page_size, cache, True, all_logits=True)
    assert rel_err(absorbed, naive_last) <= 1e-5


@pytest.mark.parametrize("block", [None, 10], ids=["whole-prefix", "prefix-in-blocks"])
def test_chunked_prefill_equals_one_shot(model, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(batch_module, "PREFIX_BLOCK_TOKENS", block)
    page_size = 16
    g = torch.Generator().manual_seed(7)
    seqs = [
        torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 97)
    ]
    pages, num_pages = scattered_pages([len(s) for s in seqs], page_size)
    cache = new_cache(model, page_size, num_pages)
    one_shot = run(
        model,
        [SeqChunk(s, 0, p) for s, p in zip(seqs, pages, strict=True)],
        page_size,
        cache,
        False,
    )
    cache = new_cache(model, page_size, num_pages)
    done = [0] * len(seqs)
    chunk = 17  # ragged: the requests finish in different steps
    while True:
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        if not live:
            break
        chunks = [SeqChunk(seqs[i][done[i] : done[i] + chunk], done[i], pages[i]) for i in live]
        logits = run(model, chunks, page_size, cache, False)
        for row, i in enumerate(live):
            done[i] = min(done[i] + chunk, len(seqs[i]))
            if done[i] == len(seqs[i]):
                assert rel_err(logits[row], one_shot[i]) <= 1e-5


def test_prefix_blocks_cut_each_prefix_at_fixed_positions_and_bound_each_launch():
    page_size, block = 4, 8
    prefixes = [0, 5, 19, 8]
    pages = [list(range(10 * b, 10 * b + 8)) for b in range(len(prefixes))]
    chunks = [SeqChunk([1, 2], n, p) for n, p in zip(prefixes, pages, strict=True)]
    blocks = batch_module._prefix_blocks(chunks, page_size, "cpu", block_tokens=block)
    pieces: dict[int, list[int]] = {b: [] for b in range(len(prefixes))}
    for blk in blocks:
        lens = blk.cu_seqlens.diff().tolist()
        assert sum(lens) == blk.slots.numel() <= block
        for b, slots in enumerate(blk.slots.split(lens)):
            if len(slots):
                pieces[b].append(len(slots))
                start = sum(pieces[b][:-1])
                assert start % block == 0  # cut at multiples of the block, in position order
                want = [pages[b][p // page_size] * page_size + p % page_size
                        for p in range(start, start + len(slots))]  # fmt: skip
                assert slots.tolist() == want
    assert {b: sum(p) for b, p in pieces.items()} == dict(enumerate(prefixes))
    assert pieces[2] == [8, 8, 3]
