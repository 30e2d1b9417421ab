"""`DecodeConfig`: the decode worker's knobs."""

from __future__ import annotations

import dataclasses

from pdserve.engine.step import MAX_DRAFTS
from pdserve.model.parallel import WorkerLayout


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeConfig:
    page_size: int = 64
    """Tokens per KV page; must equal the prefill workers'. 64 lets mla_decode read whole 64-token cache tiles
    through TMA (its Gluon kernel on Hopper); with 16-token pages it falls back to the slower tl.dot kernel."""
    num_pages: int | None = None
    """KV pages; None sizes the cache from memory (gpu_memory_fraction, cpu_cache_bytes)."""
    gpu_memory_fraction: float = 0.85
    """Share of the GPU memory left after loading the weights that the KV cache takes, at most: it never takes
    so much that less than the largest step's reserve (`pdserve plan`'s: activations, expert-exchange buffers,
    workspace) stays free within 0.9 of the GPU."""
    cpu_cache_bytes: int = 1 << 30
    """KV cache size on a CPU."""
    host_kv_cache_bytes: int = 0
    """Host memory for the host tier below the prefix cache (`pdserve.engine.host_tier`): cached KV pages the
    GPU evicts are copied there (pinned, least recently stored evicted first) and copied back when a later
    prompt goes on past its GPU hit into them. 0: off. Counted in `pdserve plan`; workers of one rank only."""
    max_running: int = 256
    """Requests in the running batch at most."""
    kv_wait_timeout_s: float = 120.0
    """Longest a request waits for its KV pages from the prefill worker before it fails."""
    max_num_batched_tokens: int = 8192
    """Token budget of a local-prefill step (aggregated path)."""
    max_prefill_chunk: int = 2048
    """Longest piece of one prompt per local-prefill step."""
    cuda_graphs: bool = True
    """On a GPU, replay decode steps as CUDA graphs (one launch per step instead of hundreds)."""
    warm_up_context: int = 8192
    """Before it serves, the worker captures the decode CUDA graph of every batch bucket for page tables of
    contexts up to this many tokens (longer contexts capture their bucket when first run); 0: none."""
    num_speculative_tokens: int = 0
    """Draft tokens the checkpoint's MTP module proposes a step for each running request, verified in the same
    step (speculative decoding; 0: off, at most 4). Greedy outputs are those of one token a step (in
    batch-invariant mode, to the bit); sampled ones follow the same distribution."""
    speculative_max_batch: int | None = 32
    """With speculation: a step drafts only while every rank runs at most this many requests (past it the
    verify rows and draft passes cost more than the tokens they add, as measured on H200s); None: always."""
    speculative_min_acceptance: float = 0.25
    """With speculation: drafting stops while the acceptance measured on the running traffic (drafts accepted
    per draft verified, a running average) is below this, probing again every 32 steps; 0: never stops."""
    speculative_relaxed_topk: int = 0
    """Relaxed acceptance for requests that opt in (`relaxed_acceptance`), inside their think block: a greedy
    request's draft among the target's this-many most likely tokens within `speculative_relaxed_delta` of the
    best log-probability is accepted (TensorRT-LLM's relaxed_topk; e.g. 10). 0: off, every draft strict."""
    speculative_relaxed_delta: float = 0.6
    """See speculative_relaxed_topk (TensorRT-LLM's relaxed_delta)."""
    enable_prefix_caching: bool = True
    """Keep the KV pages of prompts in a prefix cache (full pages, named by a hash chained through their
    parents, evicted least recently used when pages run short) and prefill only what follows the longest
    cached prefix of an aggregated request's prompt (vLLM's enable_prefix_caching, on by default as in vLLM
    and SGLang)."""
    reuse_held_prefix: bool = True
    """With enable_prefix_caching: the pages of prompts whose KV a prefill worker sent, and of finished
    requests, stay in the prefix cache, and a request whose first pages are held there when it is placed
    gets only the pages after them from its prefill worker (the previous turn of a conversation does not
    travel again)."""
    layout: WorkerLayout = WorkerLayout()
    """How one worker spreads the model over its ranks; its fields are this section's keys `ranks`,
    `attention`, `expert_parallel` and `dense` (`pdserve.cluster.config` flattens them)."""

    def __post_init__(self) -> None:
        self.layout.check_runnable()
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes={self.host_kv_cache_bytes}: must be >= 0")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 0:
            raise ValueError(
                f"speculative_max_batch={self.speculative_max_batch}: must be >= 0 (or None)"
            )
        if not 0 <= self.speculative_min_acceptance <= 1:
            raise ValueError(
                f"speculative_min_acceptance={self.speculative_min_acceptance}: must be in [0, 1]"
            )
        if self.speculative_relaxed_topk < 0 or self.speculative_relaxed_delta < 0:
            raise ValueError(
                f"speculative_relaxed_topk={self.speculative_relaxed_topk}, speculative_relaxed_delta="
                f"{self.speculative_relaxed_delta}: must be >= 0"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_DRAFTS:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens}: must be in [0, {MAX_DRAFTS}]"
            )
        if self.warm_up_context < 0:
            raise ValueError(f"warm_up_context={self.warm_up_context}: must not be negative")
        for name in ("page_size", "max_running", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages={self.num_pages}: must be positive")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction}: must be in (0, 1]")
        if self.kv_wait_timeout_s <= 0:
            raise ValueError(f"kv_wait_timeout_s={self.kv_wait_timeout_s}: must be positive")
