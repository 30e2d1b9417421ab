"""noaux_tc routing (sigmoid, biased group-limited top-k): dispatches to Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.moe_route` for the contract."""
    return implementation(__name__, router_logits).moe_route(
        router_logits,
        correction_bias,
        top_k,
        n_group,
        topk_group,
        routed_scaling_factor,
        norm_topk_prob,
        num_shared,
    )


__all__ = ["moe_route"]
