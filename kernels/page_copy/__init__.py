"""Whole-page gather and scatter of a paged KV cache (the KV transfer's copies): dispatches to Triton or the
torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def gather_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor
) -> torch.Tensor:
    """See `ref.gather_pages` for the contract."""
    return implementation(__name__, cache).gather_pages(cache, first, stop, page_ids)


def scatter_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor, packed: torch.Tensor
) -> None:
    """See `ref.scatter_pages` for the contract."""
    implementation(__name__, cache).scatter_pages(cache, first, stop, page_ids, packed)


__all__ = ["gather_pages", "scatter_pages"]
