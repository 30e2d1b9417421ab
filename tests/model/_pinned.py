"""Runs of the model for accuracy tests: routing recorded by one run and replayed in another, and the logits
of a prompt and of the decode steps after it."""

from __future__ import annotations

import contextlib

import torch

import pdserve.kernels as kernels_pkg
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache, resolve_cache_dtype


@contextlib.contextmanager
def routing(mode: str, log: list[torch.Tensor]):
    """mode "record": append every moe_route call's expert ids to `log`; "replay": use them, in order, with
    weights recomputed from this run's router logits exactly as noaux_tc weights them."""
    original = kernels_pkg.moe_route
    calls = iter(range(10**9))

    def route(logits, bias, top_k, n_group, topk_group, scaling, norm_topk_prob, num_shared=0):
        args = (logits, bias, top_k, n_group, topk_group, scaling, norm_topk_prob, num_shared)
        weights, ids = original(*args)
        if mode == "record":
            log.append(ids.clone())
            return weights, ids
        ids = log[next(calls)].to(ids.device)
        routed = ids[:, :top_k]  # then the shared experts' columns (weight 1), as recorded
        weights = logits.float().sigmoid().gather(1, routed.long())
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        shared = torch.ones(ids.shape[0], ids.shape[1] - top_k, device=ids.device)
        return torch.cat([weights * scaling, shared], dim=1), ids

    kernels_pkg.moe_route = route
    try:
        yield
    finally:
        kernels_pkg.moe_route = original


@torch.inference_mode()
def run_logits(
    model,
    prompt: list[int],
    steps: list[int] | None,
    num_steps: int,
    page_size: int = 16,
    kv_cache_dtype: str = "auto",
    prefill_chunk: int | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt` (in pieces of `prefill_chunk` tokens if given), then decode `num_steps` tokens; feeds
    `steps` (or its own greedy tokens). Returns the tokens and the logits of the last prompt position and of
    every decode step, [1 + num_steps, V] fp32."""
    device = model.embed.weight.device
    num_pages = -(-(len(prompt) + num_steps + 1) // page_size)
    dtype = resolve_cache_dtype(kv_cache_dtype, model.dtype)
    cache = PagedKVCache(
        KVCacheLayout.for_model(model.args, page_size, dtype, model.num_mtp), num_pages, device
    )
    pages = list(range(num_pages))
    chunk = prefill_chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        seq = SeqChunk(prompt[start : start + chunk], start, pages)
        batch = build_forward_batch([seq], page_size, device, decode=False)
        hidden = model(batch, cache)
    logits = [model.compute_logits(hidden[batch.logits_indices])[0].float()]
    tokens = []
    for i in range(num_steps):
        token = steps[i] if steps is not None else int(logits[-1].argmax())
        tokens.append(token)
        seq = SeqChunk([token], len(prompt) + i, pages)
        batch = build_forward_batch([seq], page_size, device, decode=True)
        logits.append(model.compute_logits(model(batch, cache))[0].float())
    return tokens, torch.stack(logits)


def relative_l2(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)
