"""The serving runtime every worker runs. For now: the router <-> worker messages and their msgpack codec
(`messages`) and the request checks shared by the front end, the schedulers and the offline path (`checks`).

Both modules are pure Python (no torch), so the router and the schedulers import them without torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DecodeRequest": "messages",
    "DecodeStats": "messages",
    "PrefillFailure": "messages",
    "PrefillRequest": "messages",
    "PrefillStats": "messages",
    "RequestOutput": "messages",
    "Reservation": "messages",
    "WorkerError": "messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
