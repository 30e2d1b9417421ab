"""FP8 block quantization as DeepSeek-V3 defines it (plain torch): the constants, the quantizers and
their inverses, shared by every op that reads or writes fp8 operands.

Weights are float8_e4m3fn [N, K] with `scale_inv` [ceil(N/128), ceil(K/128)] fp32, one per 128x128 quant block:
W = W_fp8 * scale_inv. Activations are quantized on the fly in 1x128 groups along K: x = x_fp8 * scale[m, k // 128]
with scale = max(amax(group), MIN_AMAX) / 448.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
WEIGHT_QUANT_BLOCK = 128
ACT_QUANT_GROUP = 128
MIN_AMAX = 1e-12
"""The floor of a quant group's amax, so that an all-zero group gets a finite, nonzero scale."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_act(
    x: torch.Tensor, group_size: int = ACT_QUANT_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K]. Returns x_fp8 [M, K] float8_e4m3fn and scales [M, ceil(K/group_size)] fp32."""
    m, k = x.shape
    num_groups = _ceil_div(k, group_size)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group_size - k))
    groups = padded.view(m, num_groups, group_size)  # [M, G, g]
    scales = groups.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_E4M3_MAX  # [M, G]
    q = (groups / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).view(m, num_groups * group_size)[:, :k]
    return q.contiguous(), scales


def dequantize_act(x_fp8: torch.Tensor, scales: torch.Tensor, group_size: int = ACT_QUANT_GROUP):
    """Inverse of `quantize_act`, in fp32."""
    k = x_fp8.shape[-1]
    return x_fp8.float() * scales.repeat_interleave(group_size, dim=-1)[..., :k]


def quantize_weight(
    w: torch.Tensor, block: int = WEIGHT_QUANT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float. Returns w_fp8 [N, K] float8_e4m3fn and scale_inv [ceil(N/b), ceil(K/b)] fp32."""
    n, k = w.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = padded.view(nb, block, kb, block)  # [Nb, b, Kb, b]
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp_min(MIN_AMAX) / FP8_E4M3_MAX  # [Nb, Kb]
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), scale_inv


def dequantize_weight(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: int = WEIGHT_QUANT_BLOCK,
) -> torch.Tensor:
    """w_fp8: [..., N, K]; scale_inv: [..., ceil(N/b), ceil(K/b)]. Returns W in `dtype`."""
    n, k = w_fp8.shape[-2:]
    scales = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (w_fp8.float() * scales[..., :n, :k]).to(dtype)


def check_quantized_act(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> None:
    """x_fp8 [M, K] e4m3 with x_scales [M, ceil(K/128)] fp32, as `quantize_act` returns them."""
    if x_fp8.dim() != 2 or x_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_fp8: expected 2-D e4m3, got {x_fp8.dtype} {tuple(x_fp8.shape)}")
    want = (x_fp8.shape[0], _ceil_div(x_fp8.shape[1], ACT_QUANT_GROUP))
    if x_scales.dtype != torch.float32 or tuple(x_scales.shape) != want:
        got = f"{x_scales.dtype} {tuple(x_scales.shape)}"
        raise ValueError(f"x_scales: expected fp32 {want}, got {got}")


__all__ = [
    "ACT_QUANT_GROUP",
    "FP8_E4M3_MAX",
    "MIN_AMAX",
    "WEIGHT_QUANT_BLOCK",
    "check_quantized_act",
    "dequantize_act",
    "dequantize_weight",
    "quantize_act",
    "quantize_weight",
]
