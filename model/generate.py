"""The single-process reference generation path (`pdserve offline`): prefill the prompt (optionally in chunks),
sample the first token, then decode one token per step over the paged cache. Workers are checked against it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .batch import SeqChunk, build_forward_batch
from .checks import check_context, check_token_ids
from .deepseek import Transformer
from .kv_cache import KVCacheLayout, PagedKVCache, resolve_cache_dtype
from .pages import pages_needed
from .sampler import sample_tokens
from .sampling_params import SamplingParams, check_stop


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    finish_reason: str


class OfflineGenerator:
    """Generates for one prompt at a time with a private cache sized for the longest sequence it will see."""

    def __init__(
        self, model: Transformer, page_size: int = 64, prefill_chunk: int | None = None,
        kv_cache_dtype: str = "auto",
    ):  # fmt: skip
        self.model, self.page_size, self.prefill_chunk = model, page_size, prefill_chunk
        self.device = model.embed.weight.device
        dtype = resolve_cache_dtype(kv_cache_dtype, model.dtype)
        self.layout = KVCacheLayout.for_model(model.args, page_size, dtype, model.num_mtp)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        args = self.model.args
        check_token_ids(prompt_ids, args.vocab_size, "prompt_token_ids")
        check_context(len(prompt_ids), params.max_tokens, args.max_position_embeddings)
        total = len(prompt_ids) + params.max_tokens
        params = params.with_seed()
        num_pages = pages_needed(total, self.page_size)
        cache = PagedKVCache(self.layout, num_pages, self.device)
        pages = list(range(num_pages))
        chunk = self.prefill_chunk or len(prompt_ids)
        for start in range(0, len(prompt_ids), chunk):
            seq = SeqChunk(prompt_ids[start : start + chunk], start, pages)
            batch = build_forward_batch([seq], self.page_size, self.device, decode=False)
            hidden = self.model(batch, cache)
        out: list[int] = []
        position = len(prompt_ids)
        while True:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            token = sample_tokens(logits, [params], [len(out)])[0]
            out.append(token)
            reason = check_stop(params, token, len(out), args.eos_token_ids)
            if reason is not None:
                return Generation(out, reason)
            batch = build_forward_batch(
                [SeqChunk([token], position, pages)], self.page_size, self.device, decode=True
            )
            hidden = self.model(batch, cache)
            position += 1


@torch.inference_mode()
def generate_greedy(model: Transformer, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Convenience for tests: greedy tokens, ignoring EOS."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return OfflineGenerator(model).generate(prompt_ids, params).token_ids
