"""Decode steps replayed as CUDA graphs give the eager forward's logits (bf16 tolerance: a padded bucket may run
other GEMM kernels), and the padding rows never touch the pages of real requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.runner import ModelRunner
from pdserve.kernels.mla_decode import dequantize_kv_fp8
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_graph_decode_equals_eager(tmp_path, batch, kv_cache_dtype):
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="bf16", progress=False)
    model = load_model(path, "cuda", torch.bfloat16, progress=False)
    page, ctx = 16, 40
    pages_per = -(-(ctx + 3) // page)
    runner = ModelRunner(model, page, batch * pages_per, kv_cache_dtype)

    def rows(data: torch.Tensor) -> torch.Tensor:
        """The cache's rows as floats (dequantized from fp8)."""
        if kv_cache_dtype == "auto":
            return data.float()
        return dequantize_kv_fp8(data, model.args.kv_lora_rank, model.args.qk_rope_head_dim)

    assert runner.graphs is not None and runner.cache.num_pages == batch * pages_per + 1
    tables = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(batch)]
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 1000, (ctx - b % 5,), generator=g).tolist() for b in range(batch)]
    prefill = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    runner.model(build_forward_batch(prefill, page, "cuda", decode=False), runner.cache)
    snapshot = runner.cache.data[: batch * pages_per].clone()
    for step in range(2):
        chunks = [
            SeqChunk([7 + step], len(p) + step, t) for p, t in zip(prompts, tables, strict=True)
        ]
        fb = build_forward_batch(chunks, page, "cuda", decode=True)
        # the eager step on the graph's page-table width (padded with the scratch page): mla_decode
        # then splits the cache as the graph does, and a tie in the tiny model's routing cannot flip
        # on the last bits of a different split (fp8 rows, batch 64: 0.26 apart otherwise)
        width = runner.graphs.bucket(fb)[1]
        wide = torch.full((batch, width), batch * pages_per, dtype=torch.int32, device="cuda")
        wide[:, : fb.page_table.shape[1]] = fb.page_table
        eager = model.compute_logits(model(dataclasses.replace(fb, page_table=wide), runner.cache))
        after_eager = rows(runner.cache.data[: batch * pages_per])
        graphed = runner.graphs.logits(fb)
        rel = ((graphed - eager).norm(dim=-1) / eager.norm(dim=-1)).max().item()
        assert rel < 2e-2, rel
        # The replay wrote the same tokens' KV again (same values up to rounding: for fp8 rows, up to
        # one e4m3 step, under a tenth of the row's largest value) and nothing else.
        diff = (rows(runner.cache.data[: batch * pages_per]) - after_eager).abs()
        assert (diff <= 0.1 * after_eager.abs().amax(-1, keepdim=True).clamp(min=1)).all()
    changed = (runner.cache.data[: batch * pages_per] != snapshot).any(-1)  # [pages, L, page]
    assert changed.sum().item() == 2 * batch * model.num_cache_layers - 2 * batch * model.num_mtp
