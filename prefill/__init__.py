"""The prefill worker: batches prompts under a token budget (chunking long ones), samples each prompt's first token,
and hands its KV pages to the decode worker that reserved room for it.

Its scheduling is the engine's core (`pdserve.engine.scheduler`, policy `PREFILL_ONLY`). Names are imported
lazily: the config imports without torch.

| module | its one job |
|---|---|
| `config` | `PrefillConfig`: the prefill worker's knobs |
| `worker` | `PrefillWorker`: the prefill role over the engine's scheduler, exporting KV pages |
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PrefillConfig": "config",
    "PrefillWorker": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
