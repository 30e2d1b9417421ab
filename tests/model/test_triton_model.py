"""The whole model on a GPU with the Triton kernels in bf16 against the fp32 reference path: over a 256-token
prompt and 32 decode steps the logits stay within 1e-2 relative L2.

Both runs read the same checkpoint (bf16 weights; the reference upcasts them to fp32 and runs the torch
references), and both are fed the same tokens (the reference's greedy choices), so the only differences are
activation precision and the kernels. The v2-lite-shape case makes a ~31 GB random checkpoint on the GPU host
(or reuses $PDSERVE_V2LITE_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.kernels import use_backend
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

PROMPT_LEN, DECODE_STEPS, PAGE_SIZE = 256, 32, 16


def run_logits(model, prompt: list[int], steps: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt`, then decode; feeds `steps` (or its own greedy tokens). Returns tokens and the logits of
    the last prompt position and of every decode step, [1 + DECODE_STEPS, V] fp32."""
    num_pages = -(-(PROMPT_LEN + DECODE_STEPS + 1) // PAGE_SIZE)
    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, num_pages, "cuda")
    pages = list(range(num_pages))
    batch = build_forward_batch([SeqChunk(prompt, 0, pages)], PAGE_SIZE, "cuda", decode=False)
    logits = [model.compute_logits(model(batch, cache)[batch.logits_indices])[0]]
    tokens = []
    for i in range(DECODE_STEPS):
        token = steps[i] if steps is not None else int(logits[-1].argmax())
        tokens.append(token)
        batch = build_forward_batch(
            [SeqChunk([token], PROMPT_LEN + i, pages)], PAGE_SIZE, "cuda", decode=True
        )
        logits.append(model.compute_logits(model(batch, cache))[0])
    return tokens, torch.stack(logits)


def check(path) -> float:
    g = torch.Generator().manual_seed(0)
    with use_backend("ref"):
        ref_model = load_model(path, "cuda", torch.float32, progress=False)
        vocab = ref_model.args.vocab_size
        prompt = [0, *torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=g).tolist()]
        tokens, expected = run_logits(ref_model, prompt, None)
    del ref_model
    torch.cuda.empty_cache()
    with use_backend("triton"):
        model = load_model(path, "cuda", torch.bfloat16, progress=False)
        _, got = run_logits(model, prompt, tokens)
    rel = ((got - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()
    print(f"{path.name}: max over steps of relative L2 = {rel:.2e}")
    return rel


@pytest.mark.gpu
def test_tiny_triton_bf16_matches_fp32_reference(tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="bf16", progress=False)
    assert check(path) <= 1e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_v2_lite_shape_triton_bf16_matches_fp32_reference(tmp_path):
    path = os.environ.get("PDSERVE_V2LITE_DIR")
    if path is None:
        path = make_checkpoint(
            tmp_path / "v2l", "v2-lite-shape", dtype="bf16", device="cuda", progress=False
        )
    assert check(Path(path)) <= 1e-2
