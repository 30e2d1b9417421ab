"""Per-request sampling parameters and stop rules. Pure Python: used by routers and schedulers without torch."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Collection

from .errors import InvalidRequestError

MAX_SEED = (1 << 63) - 1


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each generated token and when to stop. Invalid values raise InvalidRequestError naming the
    field."""

    max_tokens: int = 16
    """Tokens to generate at most (the first one, sampled by prefill, included)."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 disables."""
    seed: int | None = None
    """Makes sampling reproducible; None draws a seed when the request is admitted."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn at random when unset), so every worker samples alike."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.SystemRandom().randint(0, MAX_SEED))


def check_stop(
    params: SamplingParams, token_id: int, num_generated: int, eos_token_ids: Collection[int]
) -> str | None:
    """Finish reason after `token_id`, the `num_generated`-th generated token, or None to continue."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None
