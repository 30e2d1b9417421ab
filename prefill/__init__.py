"""The prefill worker: batches prompts under a token budget (chunking long ones), samples each prompt's first token,
and hands its KV pages to the decode worker that reserved room for it."""

from .config import PrefillConfig
from .scheduler import PrefillRequest, PrefillScheduler
from .worker import PrefillFailure, PrefillStats, PrefillWorker

__all__ = [
    "PrefillConfig",
    "PrefillFailure",
    "PrefillRequest",
    "PrefillScheduler",
    "PrefillStats",
    "PrefillWorker",
]
