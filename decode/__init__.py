"""The decode worker: admits requests by free KV pages, receives their KV from prefill workers (or prefills them
itself: the aggregated path), runs continuous batching with preemption by recompute, and streams tokens.

Its scheduling is the engine's core (`pdserve.engine.scheduler`, policies `DECODE_ONLY` and `AGGREGATED`).
Names are imported lazily: the config imports without torch.

| module | its one job |
|---|---|
| `config` | `DecodeConfig`: the decode worker's knobs |
| `worker` | `DecodeWorker`: the decode role over the engine's scheduler, importing KV pages, streaming tokens |
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DecodeConfig": "config",
    "DecodeWorker": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
