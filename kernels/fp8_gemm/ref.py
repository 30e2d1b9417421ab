"""FP8 block-scaled GEMM as DeepSeek-V3 runs it (plain torch reference), on the quantizers of
`kernels.fp8_quant` (which this module re-exports, as the GEMM's contract is stated in them).

Weights are float8_e4m3fn [N, K] with `scale_inv` [ceil(N/128), ceil(K/128)] fp32, one per 128x128 quant block:
W = W_fp8 * scale_inv. Activations are quantized on the fly in 1x128 groups along K: x = x_fp8 * scale[m, k // 128]
with scale = amax(group) / 448. The product is accumulated in fp32 and cast to the activation dtype.
"""

from __future__ import annotations

import torch

from ..fp8_quant import ACT_QUANT_GROUP as ACT_QUANT_GROUP
from ..fp8_quant import FP8_E4M3_MAX as FP8_E4M3_MAX
from ..fp8_quant import WEIGHT_QUANT_BLOCK as WEIGHT_QUANT_BLOCK
from ..fp8_quant import check_quantized_act, dequantize_act, dequantize_weight, quantize_act
from ..fp8_quant import quantize_weight as quantize_weight


def scaled_gemm(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The GEMM alone, on an activation already quantized (`quantize_act`'s output): x_fp8 [M, K] e4m3 with
    x_scales [M, ceil(K/128)] fp32 (any strides); w_fp8 [N, K] with w_scale_inv [ceil(N/128), ceil(K/128)].
    Returns [M, N] in out_dtype."""
    check_quantized_act(x_fp8, x_scales)
    out = dequantize_act(x_fp8, x_scales) @ dequantize_weight(w_fp8, w_scale_inv).t()
    return out.to(out_dtype)


def fp8_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float; w_fp8: [N, K] e4m3; w_scale_inv: [ceil(N/128), ceil(K/128)]. Returns [M, N] in x's dtype."""
    x_fp8, x_scales = quantize_act(x)
    return scaled_gemm(x_fp8, x_scales, w_fp8, w_scale_inv, x.dtype)
