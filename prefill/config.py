"""`PrefillConfig`: the prefill worker's knobs."""

from __future__ import annotations

import dataclasses

from pdserve.engine.step import MAX_DRAFTS
from pdserve.model.parallel import WorkerLayout


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillConfig:
    page_size: int = 64
    """Tokens per KV page; must equal the decode workers' (see DecodeConfig.page_size)."""
    num_pages: int | None = None
    """KV pages; None sizes the cache from memory (gpu_memory_fraction, cpu_cache_bytes)."""
    gpu_memory_fraction: float = 0.5
    """Share of the GPU memory left after loading the weights that the KV cache takes, at most: it never takes
    so much that less than the largest step's reserve (`pdserve plan`'s: activations, expert-exchange buffers,
    workspace) stays free within 0.9 of the GPU."""
    cpu_cache_bytes: int = 1 << 30
    """KV cache size on a CPU."""
    host_kv_cache_bytes: int = 0
    """Host memory for the host tier below the prefix cache (`pdserve.engine.host_tier`): cached KV pages the
    GPU evicts are copied there (pinned, least recently stored evicted first) and copied back when a later
    prompt goes on past its GPU hit into them. 0: off. Counted in `pdserve plan`; workers of one rank only."""
    max_num_batched_tokens: int = 8192
    """Prompt tokens per forward pass (the token budget of a step)."""
    max_prefill_chunk: int = 4096
    """Longest piece of one prompt in one step; longer prompts are prefilled in chunks."""
    num_speculative_tokens: int = 0
    """Where the decode pool speculates: > 0 runs the MTP module over every prompt (its cache layer travels
    with the KV) and sends one draft with the first token, for the decode worker's first step to verify."""
    enable_prefix_caching: bool = True
    """Keep the KV pages of prompts in a prefix cache (full pages, named by a hash chained through their
    parents, evicted least recently used when pages run short) and prefill only what follows the longest
    cached prefix of a new prompt (vLLM's enable_prefix_caching, on by default as in vLLM and SGLang)."""
    layout: WorkerLayout = WorkerLayout()
    """How one worker spreads the model over its ranks; its fields are this section's keys `ranks`,
    `attention`, `expert_parallel` and `dense` (`pdserve.cluster.config` flattens them)."""

    def __post_init__(self) -> None:
        self.layout.check_runnable()
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes={self.host_kv_cache_bytes}: must be >= 0")
        if not 0 <= self.num_speculative_tokens <= MAX_DRAFTS:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens}: must be in [0, {MAX_DRAFTS}]"
            )
        for name in ("page_size", "max_num_batched_tokens", "max_prefill_chunk", "cpu_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages={self.num_pages}: must be positive")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction}: must be in (0, 1]")
