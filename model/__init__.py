"""DeepSeek-V3 model: `ModelArgs`, the architecture (`Transformer`), its split over ranks (`WorkerLayout`,
`ParallelLayout`, `ExpertExchange`, `ExpertBalancer`), the forward batch, the paged KV cache layout, the
checkpoint loader, the tokenizer and the random-checkpoint maker. The serving runtime over it (scheduler,
runner, pages, sampler) is `pdserve.engine`.

Names are imported lazily so that torch-free modules (`pdserve.model.errors`) can be used by pure-Python
schedulers without importing torch.

| module | its one job |
|---|---|
| `args` | `ModelArgs` from a checkpoint's config.json |
| `deepseek` | the network in the paper's order |
| `parallel` | `WorkerLayout`: how a worker's model is split over its ranks; `ParallelLayout`: one rank's part |
| `expert_exchange` | expert-parallel MoE's token exchange |
| `symmetric_exchange` | the expert exchange by one-sided copies over torch symmetric memory (CUDA) |
| `expert_balance` | copies of hot experts in spare slots: their placement, routing and moves between steps |
| `shared_expert` | the shared expert as one more slot of the stacked experts |
| `batch` | `ForwardBatch`: the scheduler -> forward pass contract |
| `kv_cache` | the paged latent KV cache layout |
| `loader` | loading a checkpoint in the official layout |
| `weight_names` | the one table from checkpoint tensor names to parameters |
| `dummy_weights` | random weights of the checkpoint's shapes on the target device (`--load-format dummy`) |
| `random_checkpoint` | random-weight checkpoints for tests and benchmarks |
| `mtp_train` | one MTP module's forward in plain differentiable torch, over its weights |
| `mtp_distill` | training a checkpoint's MTP module on its main model's greedy continuations |
| `tokenizer` | the tokenizer, incremental detokenization, the local byte-level BPE (`data/`: its corpus) |
| `errors` | pdserve's error hierarchy |
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
    "WorkerLayout": "parallel",
    "ExpertExchange": "expert_exchange",
    "ExpertBalancer": "expert_balance",
    "ForwardBatch": "batch",
    "SeqChunk": "batch",
    "build_forward_batch": "batch",
    "KVCacheLayout": "kv_cache",
    "PagedKVCache": "kv_cache",
    "load_model": "loader",
    "plan_load": "loader",
    "make_checkpoint": "random_checkpoint",
    "distill_mtp": "mtp_distill",
    "Tokenizer": "tokenizer",
    "IncrementalDetokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
