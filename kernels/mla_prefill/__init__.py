"""MLA prefill attention (varlen, causal, over a cached prefix via LSE merge): Triton or torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.mla_prefill` for the contract."""
    return implementation(__name__, q).mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
    )


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.merge_attn_states` for the contract."""
    return implementation(__name__, out_a).merge_attn_states(out_a, lse_a, out_b, lse_b)


__all__ = ["merge_attn_states", "mla_prefill"]
