"""Fused MoE (permute, grouped GEMMs, SiLU-mul, weighted combine): Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `ref.fused_moe` for the contract."""
    return implementation(__name__, x).fused_moe(
        x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, x_q, tree
    )


__all__ = ["fused_moe"]
