"""Interleaved RoPE applied in place to q_pe / k_pe: dispatches to Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """See `ref.rope` for the contract."""
    implementation(__name__, q_pe).rope(q_pe, k_pe, positions, cos_sin, q_out, cache)


__all__ = ["rope"]
