"""Batched sampling (greedy, temperature, top-k, top-p, min-p, seeded): Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """See `ref.sample` for the contract."""
    return implementation(__name__, logits).sample(
        logits, temperature, top_k, top_p, min_p, seeds, steps
    )


__all__ = ["sample"]
