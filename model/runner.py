"""`ModelRunner`: executes the forward passes a worker's scheduler asks for, over one model and its KV cache, and
samples. It holds no policy: which requests run, and when, is the scheduler's business."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .batch import SeqChunk, build_forward_batch
from .deepseek import Transformer
from .kv_cache import KVCacheLayout, PagedKVCache
from .sampler import sample_tokens
from .sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    params: SamplingParams
    """Must carry a seed (SamplingParams.with_seed)."""
    step: int
    """How many tokens the request generated before this one."""


class ModelRunner:
    def __init__(self, model: Transformer, page_size: int, num_pages: int, cache_dtype=None):
        self.model, self.page_size = model, page_size
        self.device = model.embed.weight.device
        layout = KVCacheLayout.for_model(
            model.args, page_size, cache_dtype or model.dtype, model.num_mtp
        )
        self.cache = PagedKVCache(layout, num_pages, self.device)

    @torch.inference_mode()
    def prefill(
        self, chunks: Sequence[SeqChunk], samples: Sequence[SampleSpec | None]
    ) -> list[int | None]:
        """Runs prompt chunks (writing their KV); samples the next token where `samples[i]` is given (the
        request's last chunk)."""
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=False)
        hidden = self.model(batch, self.cache)
        rows = [i for i, s in enumerate(samples) if s is not None]
        out: list[int | None] = [None] * len(chunks)
        if rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices[rows]])
            specs = [samples[i] for i in rows]
            tokens = sample_tokens(logits, [s.params for s in specs], [s.step for s in specs])
            for i, t in zip(rows, tokens, strict=True):
                out[i] = t
        return out

    @torch.inference_mode()
    def decode(self, chunks: Sequence[SeqChunk], samples: Sequence[SampleSpec]) -> list[int]:
        """One decode step: each chunk is one request's last token; returns each request's next token."""
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=True)
        logits = self.model.compute_logits(self.model(batch, self.cache))
        return sample_tokens(logits, [s.params for s in samples], [s.step for s in samples])
