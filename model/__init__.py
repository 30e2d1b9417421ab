"""DeepSeek-V3 model: `ModelArgs`, the architecture (`Transformer`), its split over ranks (`ParallelLayout`,
`ExpertExchange`), the paged KV cache layout, the checkpoint loader, the sampler, the tokenizer and the
random-checkpoint maker.

Names are imported lazily so that torch-free modules (`pdserve.model.pages`, `pdserve.model.errors`) can be used by
pure-Python schedulers without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelArgs": "args",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "InvalidRequestError": "errors",
    "PdserveError": "errors",
    "Transformer": "deepseek",
    "ParallelLayout": "parallel",
    "ExpertExchange": "expert_exchange",
    "ForwardBatch": "batch",
    "SeqChunk": "batch",
    "build_forward_batch": "batch",
    "KVCacheLayout": "kv_cache",
    "PagedKVCache": "kv_cache",
    "PageAllocator": "pages",
    "load_model": "loader",
    "plan_load": "loader",
    "make_checkpoint": "random_checkpoint",
    "SamplingParams": "sampling_params",
    "Tokenizer": "tokenizer",
    "IncrementalDetokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
