"""Prefill on GPU 0, decode on GPU 1, KV pages over NCCL, on the v2-lite-shape random checkpoint in bf16:
outputs against the single-process GPU path.

Both sides run in batch-invariant mode (PDSERVE_BATCH_INVARIANT=1: kernels whose per-token arithmetic does not
depend on the batch), so every request's greedy tokens must equal the single-process path's exactly, whether
the requests run one at a time or sixteen at once. Where one does not, the message gives the step and that
step's top-2 logit gap, which tells a near-tie flip from a real bug. The checkpoint is $PDSERVE_V2LITE_DIR, or
made here (~31 GB)."""

from __future__ import annotations

import socket

import pytest
import torch

from pdserve.decode import DecodeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.prefill import PrefillConfig

from .harness import MiniRouter
from .procs import WorkerProcess

pytestmark = [pytest.mark.multi_gpu, pytest.mark.slow]
MAX_TOKENS, PAGE_SIZE = 24, 16


@pytest.fixture(scope="module")
def model_dir(v2lite_dir):
    return v2lite_dir


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


def check(request_id: str, result, expected: tuple[list[int], list[float]]) -> None:
    tokens, gaps = expected
    assert result.error is None, (request_id, result.error)
    if result.token_ids != tokens:
        pairs = zip(result.token_ids, tokens, strict=True)
        first = next(i for i, (a, b) in enumerate(pairs) if a != b)
        raise AssertionError(
            f"{request_id}: tokens differ from step {first} (top-2 gap there {gaps[first]:.2%} of the "
            f"top logit): {result.token_ids} != {tokens}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_two_gpu_outputs_match_single_gpu(model_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "1")  # here and in the worker processes
    work = {"sequential": prompts(6, seed=1), "concurrent": prompts(16, seed=2)}
    model = load_model(model_dir, "cuda:0", torch.bfloat16, progress=False)
    expected = {k: reference(model, p) for batch in work.values() for k, p in batch.items()}
    del model
    torch.cuda.empty_cache()
    # Every transfer cut into pieces of at most 2 MiB (these prompts are under 20 MB): the pipelined path.
    kv = KVTransferConfig(
        store_port=free_port(), timeout_s=60, pipeline_min_bytes=0, chunk_bytes=2 * 2**20
    )
    d = WorkerProcess("decode", "d0", model_dir, DecodeConfig(gpu_memory_fraction=0.5), kv, True,
                      device="cuda:1", dtype="bfloat16")  # fmt: skip
    p = WorkerProcess("prefill", "p0", model_dir, PrefillConfig(gpu_memory_fraction=0.3), kv,
                      device="cuda:0", dtype="bfloat16")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        for request_id, prompt in work["sequential"].items():
            router = MiniRouter(d, "d0", p, "p0")
            router.submit(request_id, prompt, params)
            check(request_id, router.run_until_done(300)[request_id], expected[request_id])
        router = MiniRouter(d, "d0", p, "p0")
        for request_id, prompt in work["concurrent"].items():
            router.submit(request_id, prompt, params)
        results = router.run_until_done(300)
        for request_id, result in results.items():
            check(request_id, result, expected[request_id])
        print(
            f"{len(work['sequential'])} sequential and {len(results)} concurrent requests identical"
        )
        assert p.stats().pages_used == 0 and d.stats().pages_used == 0
    finally:
        p.stop()
        d.stop()


def test_nccl_two_gpu_speculative_outputs_match_single_gpu(tmp_path_factory, monkeypatch):
    """MTP speculation across the two GPUs (the tiny model, which has an MTP module): the prefill worker fills
    the MTP cache layer and sends a draft with the first token, the decode worker verifies K = 2 drafts a step
    with its graphs; every greedy stream equals the single-process path's, in batch-invariant mode."""
    from pdserve.model.random_checkpoint import make_checkpoint

    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "1")
    tiny = make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", "tiny", dtype="bf16")
    g = torch.Generator().manual_seed(5)
    work = {
        f"s{i}": [0, *torch.randint(3, 1000, (int(n),), generator=g).tolist()]
        for i, n in enumerate(torch.randint(1, 200, (12,), generator=g))
    }
    model = load_model(tiny, "cuda:0", torch.bfloat16, progress=False)
    expected = {k: reference(model, p) for k, p in work.items()}
    del model
    torch.cuda.empty_cache()
    kv = KVTransferConfig(store_port=free_port(), timeout_s=60)
    spec = {"num_speculative_tokens": 2, "gpu_memory_fraction": 0.3}
    d = WorkerProcess("decode", "d0", tiny, DecodeConfig(speculative_min_acceptance=0.0, **spec),
                      kv, True, device="cuda:1", dtype="bfloat16")  # fmt: skip
    p = WorkerProcess("prefill", "p0", tiny, PrefillConfig(**spec), kv, device="cuda:0",
                      dtype="bfloat16")  # fmt: skip
    try:
        router = MiniRouter(d, "d0", p, "p0")
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        for request_id, prompt in work.items():
            router.submit(request_id, prompt, params)
        for request_id, result in router.run_until_done(300).items():
            check(request_id, result, expected[request_id])
        assert p.stats().pages_used == 0 and d.stats().pages_used == 0
    finally:
        p.stop()
        d.stop()
