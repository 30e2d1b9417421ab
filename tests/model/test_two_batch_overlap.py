"""Two-batch overlap on DP2 + EP2 ranks over gloo (whose collectives run in flight on their own threads): a decode
step run as two micro-batches, each MoE layer's exchange of one in flight while the other computes, gives the
single pass's fp32 outputs per row, whether a rank holds several requests, one (its second micro-batch joins
the exchanges with no tokens) or none (it joins all four exchanges of each layer idle); so does a prefill pass
whose tokens are cut in half (a request's chunk continuing in the second micro-batch)."""

from __future__ import annotations

import pytest
import torch
from _parallel_ranks import spawn_gloo

from pdserve.model.batch import ForwardBatch, SeqChunk, build_forward_batch
from pdserve.model.errors import ConfigError
from pdserve.model.loader import load_model
from pdserve.model.parallel import WorkerLayout

PAGE, NUM_PAGES = 16, 48


def _chunks(prompts: list[list[int]], first: int, decode: bool) -> list[SeqChunk]:
    """Request i's pages start at (first + i) * 8; decode chunks feed token 7 after the prompt."""
    out = []
    for i, p in enumerate(prompts):
        pages = list(range((first + i) * 8, (first + i) * 8 + 3))
        out.append(SeqChunk([7], len(p), pages) if decode else SeqChunk(p, 0, pages))
    return out


def _overlap_rank(rank, world, ckpt, prompts, first, max_rows):
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
    from pdserve.model.parallel import ParallelLayout

    layout = ParallelLayout(WorkerLayout(world, "data", expert_parallel=world), rank=rank)
    model = load_model(ckpt, dtype=torch.float32, progress=False, layout=layout)
    cache = PagedKVCache(
        KVCacheLayout.for_model(model.args, PAGE, torch.float32, model.num_mtp), NUM_PAGES, "cpu"
    )
    from pdserve.engine.runner import split_chunks

    out = {}
    step = 64  # at least the prompt tokens of any rank
    for two in (True, False):  # the prompts' KV, the second pass writing what the first did
        with model.step_tokens(step, two_batches=two):
            chunks = _chunks(prompts, first, False)
            if not prompts:
                model.forward_idle()
            elif two:
                halves = [build_forward_batch(p, PAGE, "cpu", False) if p else None
                          for p in split_chunks(chunks)]  # fmt: skip
                out["prefill", two] = model.forward_micro_batches(halves, cache)
            else:
                out["prefill", two] = model(build_forward_batch(chunks, PAGE, "cpu", False), cache)
    for two in (False, True):
        with model.step_tokens(max_rows, two_batches=two):
            if prompts:
                batch = build_forward_batch(_chunks(prompts, first, True), PAGE, "cpu", True)
                out[two] = model(batch, cache)
            else:
                model.forward_idle()
    return out


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "rows,variant",
    [((3, 1), "tiny-fp32"), ((4, 0), "tiny-fp32"), ((3, 1), "tiny-fp8")],
    ids=["three-and-one", "four-and-idle", "fp8-three-and-one"],
)
def test_two_micro_batches_give_the_single_pass_outputs(rows, variant, checkpoint, tmp_path):
    ckpt = checkpoint(variant)
    vocab = load_model(ckpt, progress=False).args.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 12)]
    by_rank = [prompts[: rows[0]], prompts[rows[0] : rows[0] + rows[1]]]
    firsts = [0, rows[0]]
    results = spawn_gloo(
        tmp_path, _overlap_rank,
        [(str(ckpt), mine, first, max(rows)) for mine, first in zip(by_rank, firsts, strict=True)],
    )  # fmt: skip
    for result, mine in zip(results, by_rank, strict=True):
        if not mine:
            assert result == {}
            continue
        single, two = result[False], result[True]
        assert single.shape == two.shape == (len(mine), single.shape[1])
        assert ((two - single).abs().max() / single.abs().max()).item() <= 1e-5
        single, two = result["prefill", False], result["prefill", True]
        assert single.shape == two.shape == (sum(len(p) for p in mine), single.shape[1])
        if variant == "tiny-fp8":
            # the experts' GEMMs run over half the padded rows, and a last-bit difference can move an
            # intermediate value re-quantized to fp8 onto the next fp8 step: one row of 12 here
            continue
        assert ((two - single).abs().max() / single.abs().max()).item() <= 1e-5


def test_prefill_chunks_split_at_half_their_tokens():
    from pdserve.engine.runner import split_chunks

    chunks = [SeqChunk([1, 2, 3], 0, [0]), SeqChunk([4, 5, 6, 7, 8], 10, [1, 2])]
    first, second = split_chunks(chunks)
    assert [(c.token_ids, c.num_computed_tokens) for c in first] == [([1, 2, 3], 0), ([4], 10)]
    assert [(c.token_ids, c.num_computed_tokens, c.page_ids) for c in second] == [
        ([5, 6, 7, 8], 11, [1, 2])
    ]
    assert split_chunks([SeqChunk([9], 0, [0])]) == ([SeqChunk([9], 0, [0])], [])


def test_split_keeps_each_requests_rows():
    chunks = [SeqChunk([3], 4, [0]), SeqChunk([5], 9, [1]), SeqChunk([6], 2, [2])]
    batch = build_forward_batch(chunks, PAGE, "cpu", decode=True)
    a, b = batch.split(2)
    assert a.input_ids.tolist() == [3, 5] and b.input_ids.tolist() == [6]
    assert b.cu_seqlens_q.tolist() == [0, 1] and b.seq_lens.tolist() == [3]
    assert b.page_table.tolist() == [[2]] and b.logits_indices.tolist() == [0]
    with pytest.raises(ValueError, match="split\\(3\\)"):
        batch.split(3)
    prefill = build_forward_batch(chunks, PAGE, "cpu", decode=False)
    assert isinstance(prefill, ForwardBatch)
    with pytest.raises(ValueError, match="needs a decode batch"):
        prefill.split(1)


def test_overlap_rows_needs_data_parallel_expert_parallel_ranks():
    assert WorkerLayout(2, "data", expert_parallel=2, overlap_rows=64).overlap_rows == 64
    with pytest.raises(ConfigError, match="overlap_rows=1: must be 0 \\(off\\) or >= 2"):
        WorkerLayout(2, "data", expert_parallel=2, overlap_rows=1)
    with pytest.raises(ConfigError, match="with expert_parallel > 1"):
        WorkerLayout(2, "data", overlap_rows=64)
    with pytest.raises(ConfigError, match="needs attention='data'"):
        WorkerLayout(2, "tensor", expert_parallel=2, overlap_rows=64).check_runnable()
