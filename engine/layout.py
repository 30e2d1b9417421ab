"""How a pool's config spreads one worker over ranks: the validation shared by `PrefillConfig` and
`DecodeConfig` (fields `ranks`, `attention`, `expert_parallel`, `dense`) and the `ParallelLayout` a rank builds
from them. Pure Python at import (no torch)."""

from __future__ import annotations

from typing import Any

ATTENTION_MODES = ("data", "tensor")
DENSE_MODES = ("replicated", "tensor")


def check_layout_fields(config: Any) -> None:
    """Raises ValueError naming the field when a config's layout fields do not describe a valid layout."""
    ranks, attention = config.ranks, config.attention
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: must be >= 1")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_MODES}")
    if config.expert_parallel not in (1, ranks):
        raise ValueError(f"expert_parallel={config.expert_parallel}: must be 1 or ranks={ranks}")
    if config.dense not in DENSE_MODES:
        raise ValueError(f"dense={config.dense!r}: expected one of {DENSE_MODES}")
    if config.dense == "tensor" and attention != "tensor" and ranks > 1:
        raise ValueError(
            "dense='tensor': needs attention='tensor' (with data-parallel attention the ranks hold "
            "different tokens)"
        )


def data_parallel_ranks(config: Any) -> int:
    """Ranks holding different requests (and their own KV pages): `ranks` with data-parallel attention,
    else 1 (tensor-parallel attention replicates MLA's latent cache on every rank)."""
    return config.ranks if config.attention == "data" else 1


def rows_per_rank(max_running: int | None, dp_ranks: int) -> int | None:
    """A worker's `max_running` requests shared by its `dp_ranks` data-parallel ranks: the most one rank holds
    (and so the largest decode batch its graphs need); None: no limit."""
    return None if max_running is None else -(-max_running // dp_ranks)


def layout_kwargs(config: Any) -> dict[str, Any]:
    """The `ParallelLayout` fields a rank of this config takes, besides its rank and group (plain values)."""
    return {
        "world_size": config.ranks,
        "attention": config.attention,
        "expert_parallel": config.expert_parallel,
        "dense": config.dense,
    }
