"""MLA decode attention (absorbed, paged latent cache): dispatches to Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.mla_decode` for the contract."""
    return implementation(__name__, q).mla_decode(
        q, kv_cache, page_table, seq_lens, softmax_scale, kv_lora_rank
    )


__all__ = ["mla_decode"]
