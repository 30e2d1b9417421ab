"""MLA decode attention (absorbed, paged latent cache, bf16 or fp8 cache) and the cache writers:
dispatches to Triton or the torch reference. `quantize_kv_fp8` / `dequantize_kv_fp8` are the fp8 row
format in plain torch (any device); `fp8_format` (the shared module `kernels.kv_row_fp8`) documents
the format."""

from __future__ import annotations

import torch

from .. import kv_row_fp8 as fp8_format
from .._backend import implementation
from ..kv_row_fp8 import dequantize_kv_fp8, quantize_kv_fp8


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


def write_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """See `ref.write_kv` for the contract."""
    implementation(__name__, kv_cache).write_kv(kv_cache, slots, c_kv, k_pe)


def write_kv_fp8(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """See `ref.write_kv_fp8` for the contract."""
    implementation(__name__, kv_cache).write_kv_fp8(kv_cache, slots, c_kv, k_pe)


__all__ = [
    "dequantize_kv_fp8", "fp8_format", "mla_decode", "quantize_kv_fp8", "write_kv", "write_kv_fp8",
]  # fmt: skip
