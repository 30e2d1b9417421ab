"""silu(gate) * up in Triton, optionally quantized to e4m3 in 1x128 groups: same contract and rounding as
`ref.silu_mul`.

One program takes BLOCK_M rows of one 128-column group: it computes the product in fp32, rounds it to gate's
dtype, and either stores it or quantizes that rounded tile (`quantize_tile`, the fp8 GEMMs' own quantizer) and
stores the e4m3 values and the group's scale. The scales come back as an [T, G] view of [G, T] storage, the
layout the fp8 GEMM loads fastest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import tuning
from .._backend import interpreter_enabled, pdl_enabled
from ..fp8_quant import ACT_QUANT_GROUP, FP8_E4M3_MAX, MIN_AMAX
from ..fp8_quant_triton import empty_quantized, quantize_tile
from .ref import check_inputs

tuning.register("silu_mul", "any", {"default": {"BLOCK_M": 8, "num_warps": 4}})


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, scale_ptr, T, I,
    stride_gt, stride_ut, stride_ot, stride_st, stride_sg,
    QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the next kernel (a decode GEMM) may launch and start on its weights; launched early
        gdc_launch_dependents()  # ourselves (launch_pdl), we wait for the kernel before
        gdc_wait()
    g = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = g * GROUP + tl.arange(0, GROUP)
    mask = (offs_t < T)[:, None] & (offs_i < I)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    gate = tl.load(gate_ptr + rows * stride_gt + offs_i[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    up = tl.load(up_ptr + rows * stride_ut + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    h = (gate * tl.sigmoid(gate) * up).to(gate_ptr.dtype.element_ty)
    if QUANT:
        q, scale = quantize_tile(h.to(tl.float32), FP8_MAX, MIN_AMAX, EXACT_CAST)
        tl.store(out_ptr + rows * stride_ot + offs_i[None, :], q, mask=mask)
        tl.store(scale_ptr + offs_t * stride_st + g * stride_sg, scale, mask=offs_t < T)
    else:
        tl.store(out_ptr + rows * stride_ot + offs_i[None, :], h, mask=mask)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, quant: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """gate, up: [T, I] (rows may have any stride). Returns silu(gate) * up [T, I] in gate's dtype, or with
    `quant` (x_fp8 [T, I] float8_e4m3fn, scales [T, ceil(I/128)] fp32 column-major) of that value."""
    check_inputs(gate, up)
    t, i = gate.shape
    num_groups = triton.cdiv(i, ACT_QUANT_GROUP)
    if quant:
        out, scales = empty_quantized(t, i, gate.device)
    else:
        out = torch.empty((t, i), dtype=gate.dtype, device=gate.device)
        scales = torch.empty((1, 1), dtype=torch.float32, device=gate.device)  # unread
    if t and i:
        cfg = tuning.lookup("silu_mul", "default", gate.device)
        pdl = pdl_enabled(gate.device)
        _silu_mul_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), num_groups)](
            gate, up, out, scales, t, i,
            gate.stride(0), up.stride(0), out.stride(0), scales.stride(0), scales.stride(1),
            QUANT=quant, GROUP=ACT_QUANT_GROUP, BLOCK_M=cfg["BLOCK_M"],
            FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX, EXACT_CAST=interpreter_enabled(),
            PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl,
        )  # fmt: skip
    return (out, scales) if quant else out
