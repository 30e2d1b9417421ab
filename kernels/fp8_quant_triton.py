"""FP8 activation quantization in Triton, shared by the kernels that produce or consume fp8
activations: the storage of a quantized activation, the in-kernel quantizer of one tile
(`quantize_tile`, 1 x group quant groups), and the standalone quantizing launch (`quantize_rows`).

Same arithmetic as `fp8_quant.quantize_act` (scale = max(amax, MIN_AMAX) / 448 per group, the
quotient rounded to the nearest e4m3) with correctly rounded divisions, so the scales match the
reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import tuning
from ._backend import interpreter_enabled, pdl_enabled
from .fp8_quant import ACT_QUANT_GROUP, FP8_E4M3_MAX, MIN_AMAX


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


@triton.jit
def _quantize_act_kernel(
    x_ptr, q_ptr, s_ptr, M, K,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the next kernel (the GEMM) may launch and start on its weights; launched early
        gdc_launch_dependents()  # ourselves (launch_pdl), we wait for the kernel before
        gdc_wait()
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = g * GROUP + tl.arange(0, GROUP)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    q, scale = quantize_tile(x.to(tl.float32), FP8_MAX, MIN_AMAX, EXACT_CAST)
    tl.store(q_ptr + rows * stride_qm + offs_k[None, :] * stride_qk, q, mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + g * stride_sg, scale, mask=offs_m < M)


def quantize_rows(
    x: torch.Tensor, group_size: int, scale_column_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype and strides; not checked here) quantized in 1 x group_size groups
    in one launch: (e4m3 [M, K], fp32 scales [M, ceil(K / group_size)]) in `empty_quantized`'s
    storage, the scales column-major when scale_column_major."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    q, scales = empty_quantized(m, k, x.device, group_size, scale_column_major)
    if m == 0 or k == 0:
        return q, scales
    cfg = tuning.lookup("quantize_act", f"group={group_size}", x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), num_groups)
    pdl = pdl_enabled(x.device)
    _quantize_act_kernel[grid](
        x, q, scales, m, k,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1),
        GROUP=group_size, BLOCK_M=cfg["BLOCK_M"], FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX,
        EXACT_CAST=interpreter_enabled(), PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl,
    )  # fmt: skip
    return q, scales


__all__ = ["empty_quantized", "quantize_rows", "quantize_tile"]
