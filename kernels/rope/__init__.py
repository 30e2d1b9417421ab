"""Interleaved RoPE applied in place to q_pe / k_pe: dispatches to Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation
from ..mla_decode import write_kv_fp8


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """See `ref.rope` for the contract. An fp8 cache (uint8 rows) takes the rotation and the write in two
    launches: k_pe is rotated into a copy, which `write_kv_fp8` quantizes into the cache with c_kv."""
    impl = implementation(__name__, q_pe)
    if cache is not None and cache[0].dtype == torch.uint8:
        kv_cache, slots, c_kv = cache
        k_rot = k_pe.clone()
        impl.rope(q_pe, k_rot, positions, cos_sin, q_out)
        write_kv_fp8(kv_cache, slots, c_kv, k_rot.view(k_rot.shape[0], -1))
        return
    impl.rope(q_pe, k_pe, positions, cos_sin, q_out, cache)


__all__ = ["rope"]
