"""FP8 block-scaled GEMM (1x128 activation groups, 128x128 weight blocks): Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation
from ..fp8_quant import (
    ACT_QUANT_GROUP,
    FP8_E4M3_MAX,
    WEIGHT_QUANT_BLOCK,
    dequantize_act,
    dequantize_weight,
    quantize_weight,
)


def fp8_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """See `ref.fp8_gemm` for the contract."""
    return implementation(__name__, x).fp8_gemm(x, w_fp8, w_scale_inv)


def scaled_gemm(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """See `ref.scaled_gemm` for the contract."""
    return implementation(__name__, x_fp8).scaled_gemm(
        x_fp8, x_scales, w_fp8, w_scale_inv, out_dtype
    )


def quantize_act(x: torch.Tensor, group_size: int = ACT_QUANT_GROUP):
    """See `fp8_quant.quantize_act` for the contract."""
    return implementation(__name__, x).quantize_act(x, group_size)


__all__ = [
    "ACT_QUANT_GROUP",
    "FP8_E4M3_MAX",
    "WEIGHT_QUANT_BLOCK",
    "dequantize_act",
    "dequantize_weight",
    "fp8_gemm",
    "quantize_act",
    "quantize_weight",
    "scaled_gemm",
]
