"""The decode worker: admits requests by free KV pages, receives their KV from prefill workers (or prefills them
itself: the aggregated path), runs continuous batching with preemption by recompute, and streams tokens.

Names are imported lazily: the scheduler imports without torch (its messages are `pdserve.engine.messages`)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DecodeConfig": "config",
    "DecodeScheduler": "scheduler",
    "RequestState": "scheduler",
    "DecodeWorker": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
