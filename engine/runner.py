"""`ModelRunner`: executes the forward passes a worker's scheduler asks for, over one model and its KV cache, and
samples. It holds no policy: which requests run, and when, is the scheduler's business."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.deepseek import Transformer
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache, capacity_pages, resolve_cache_dtype

from .cuda_graphs import DecodeGraphs
from .sampler import sample_tokens
from .sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    params: SamplingParams
    """Must carry a seed (SamplingParams.with_seed)."""
    step: int
    """How many tokens the request generated before this one."""


class ModelRunner:
    """`num_pages` usable pages (ids 0 .. num_pages - 1). On a GPU with `cuda_graphs`, decode steps replay CUDA
    graphs and the cache holds one more page, the graphs' scratch page, which no request may own."""

    def __init__(
        self, model: Transformer, page_size: int, num_pages: int, kv_cache_dtype: str = "auto",
        cuda_graphs: bool = True,
    ):  # fmt: skip
        self.model, self.page_size, self._num_pages = model, page_size, num_pages
        self.device = model.embed.weight.device
        layout = KVCacheLayout.for_model(
            model.args, page_size, resolve_cache_dtype(kv_cache_dtype, model.dtype), model.num_mtp
        )
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.cache = PagedKVCache(layout, num_pages + int(use_graphs), self.device)
        self.graphs = (
            DecodeGraphs(model, self.cache, scratch_page=num_pages) if use_graphs else None
        )

    @classmethod
    def sized(
        cls,
        model: Transformer,
        page_size: int,
        num_pages: int | None,
        gpu_memory_fraction: float,
        cpu_cache_bytes: int,
        cuda_graphs: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> ModelRunner:
        """A runner whose cache has `num_pages`, or as many as `capacity_pages` finds room for."""
        cache_dtype = resolve_cache_dtype(kv_cache_dtype, model.dtype)
        layout = KVCacheLayout.for_model(model.args, page_size, cache_dtype, model.num_mtp)
        device = model.embed.weight.device
        pages = capacity_pages(layout, device, num_pages, gpu_memory_fraction, cpu_cache_bytes)
        if num_pages is None and device.type == "cuda" and cuda_graphs:
            pages -= 1  # room for the graphs' scratch page
        return cls(model, page_size, pages, kv_cache_dtype, cuda_graphs)

    @property
    def num_pages(self) -> int:
        """Pages requests may own."""
        return self._num_pages

    def _on_device(self):
        """Triton launches on the calling thread's current CUDA device, which is per thread: make it ours."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    @torch.inference_mode()
    def prefill(
        self, chunks: Sequence[SeqChunk], samples: Sequence[SampleSpec | None]
    ) -> list[int | None]:
        """Runs prompt chunks (writing their KV); samples the next token where `samples[i]` is given (the
        request's last chunk)."""
        with self._on_device():
            return self._prefill(chunks, samples)

    def _prefill(self, chunks, samples) -> list[int | None]:
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
        with self._on_device():
            return self._decode(chunks, samples)

    def _decode(self, chunks, samples) -> list[int]:
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=True)
        if self.graphs is not None:
            logits = self.graphs.logits(batch)
        else:
            logits = self.model.compute_logits(self.model(batch, self.cache))
        return sample_tokens(logits, [s.params for s in samples], [s.step for s in samples])
