"""Activation quantization of one tile to e4m3 in 1x128 groups, shared by the fp8 kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ref import ACT_QUANT_GROUP


def empty_quantized(
    rows: int,
    cols: int,
    device: torch.device,
    group: int = ACT_QUANT_GROUP,
    column_major: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage for a quantized activation: (e4m3 [rows, cols], fp32 scales [rows, ceil(cols / group)]),
    the scales by default an [rows, G] view of [G, rows] storage, so that the fp8 GEMMs load (and the
    quantizing kernels store) a tile's rows of one group contiguously; row-major with
    column_major=False (for readers that gather rows, as fused_moe's gate/up GEMM does)."""
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device)
    groups = triton.cdiv(cols, group)
    if not column_major:
        return q, torch.empty((rows, groups), dtype=torch.float32, device=device)
    return q, torch.empty((groups, rows), dtype=torch.float32, device=device).t()


@triton.jit
def _round_to_e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32."""
    # e4m3 normals start at 2^-6; below that the spacing stays 2^-9
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_ulp = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding, then subtracting it rounds |r| < 2^22, ties to even
    return ((v * inv_ulp + magic) - magic) * ulp


@triton.jit
def quantize_tile(x, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr):
    """x: [R, G] fp32, one quant group per row. Returns (x_fp8 [R, G], scale [R]).

    EXACT_CAST rounds to the e4m3 grid in fp32 first: the Triton 3.9 interpreter's fp32 -> fp8
    cast rounds half up and drops the carry into the exponent (127 becomes 64); the GPU's is right.
    """
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)  # `/` is approximate on GPUs
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    if EXACT_CAST:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), scale
