"""The decode worker: admits requests by free KV pages, receives their KV from prefill workers (or prefills them
itself: the aggregated path), runs continuous batching with preemption by recompute, and streams tokens."""

from .config import DecodeConfig
from .scheduler import DecodeRequest, DecodeScheduler, RequestOutput, RequestState
from .worker import DecodeStats, DecodeWorker, Reservation

__all__ = [
    "DecodeConfig",
    "DecodeRequest",
    "DecodeScheduler",
    "DecodeStats",
    "DecodeWorker",
    "RequestOutput",
    "RequestState",
    "Reservation",
]
