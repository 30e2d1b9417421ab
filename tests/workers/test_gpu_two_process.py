"""Prefill on GPU 0, decode on GPU 1, KV pages over NCCL, on the v2-lite-shape random checkpoint in bf16:
outputs against the single-process GPU path.

Requests run one at a time give every forward pass the same shapes as the single-process path, so the tokens
must be identical. Run concurrently, the batches differ (cuBLAS picks other kernels for other row counts), and in
bf16 a request may legitimately part ways with the reference where its top two logits nearly tie; the test
then requires that every divergence starts at such a near-tie (gap < 2% of the top logit) and reports how many
requests matched exactly. The checkpoint is $PDSERVE_V2LITE_DIR, or made here (~31 GB)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from pdserve.decode import DecodeConfig
from pdserve.kvtransfer import KVTransferConfig
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.model.sampling_params import SamplingParams
from pdserve.prefill import PrefillConfig

from .harness import MiniRouter
from .procs import WorkerProcess

pytestmark = [pytest.mark.multi_gpu, pytest.mark.slow]
MAX_TOKENS, PAGE_SIZE, NEAR_TIE = 24, 16, 0.02


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = os.environ.get("PDSERVE_V2LITE_DIR")
    if path:
        return Path(path)
    out = tmp_path_factory.mktemp("ck") / "v2l"
    return make_checkpoint(out, "v2-lite-shape", dtype="bf16", device="cuda", progress=False)


def prompts(count: int, seed: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 600, (count,), generator=g).tolist()
    return {f"r{seed}-{i}": [0, *torch.randint(3, 100000, (length - 1,), generator=g).tolist()]
            for i, length in enumerate(lengths)}  # fmt: skip


@torch.inference_mode()
def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of the single-process path and, per token, the top-2 gap relative to the top logit."""
    pages = list(range(-(-(len(prompt) + MAX_TOKENS) // PAGE_SIZE)))
    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, len(pages), "cuda")
    batch = build_forward_batch([SeqChunk(prompt, 0, pages)], PAGE_SIZE, "cuda", decode=False)
    logits = model.compute_logits(model(batch, cache)[batch.logits_indices])[0]
    tokens, gaps = [], []
    for i in range(MAX_TOKENS):
        top = logits.topk(2).values
        gaps.append(((top[0] - top[1]) / top[0].abs()).item())
        tokens.append(int(logits.argmax()))
        batch = build_forward_batch(
            [SeqChunk([tokens[-1]], len(prompt) + i, pages)], PAGE_SIZE, "cuda", decode=True
        )
        logits = model.compute_logits(model(batch, cache))[0]
    return tokens, gaps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_two_gpu_outputs_match_single_gpu(model_dir):
    work = {"sequential": prompts(6, seed=1), "concurrent": prompts(16, seed=2)}
    model = load_model(model_dir, "cuda:0", torch.bfloat16, progress=False)
    expected = {k: reference(model, p) for batch in work.values() for k, p in batch.items()}
    del model
    torch.cuda.empty_cache()
    kv = KVTransferConfig(store_port=free_port(), timeout_s=60)
    d = WorkerProcess("decode", "d0", model_dir, DecodeConfig(gpu_memory_fraction=0.5), kv, True,
                      device="cuda:1", dtype="bfloat16")  # fmt: skip
    p = WorkerProcess("prefill", "p0", model_dir, PrefillConfig(gpu_memory_fraction=0.3), kv,
                      device="cuda:0", dtype="bfloat16")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        for request_id, prompt in work["sequential"].items():
            router = MiniRouter(d, "d0", p, "p0")
            router.submit(request_id, prompt, params)
            got = router.run_until_done(300)[request_id]
            assert got.error is None and got.token_ids == expected[request_id][0], request_id
        router = MiniRouter(d, "d0", p, "p0")
        for request_id, prompt in work["concurrent"].items():
            router.submit(request_id, prompt, params)
        results = router.run_until_done(300)
        exact = 0
        for request_id, result in results.items():
            tokens, gaps = expected[request_id]
            assert result.error is None, result.error
            if result.token_ids == tokens:
                exact += 1
                continue
            first = next(
                i for i, (a, b) in enumerate(zip(result.token_ids, tokens, strict=True)) if a != b
            )
            assert gaps[first] < NEAR_TIE, (request_id, first, gaps[first])
        print(
            f"concurrent: {exact}/{len(results)} requests token-identical; the rest part at near-ties"
        )
        assert p.stats().pages_used == 0 and d.stats().pages_used == 0
    finally:
        p.stop()
        d.stop()
