"""RMSNorm (+ fused residual add) in Triton: same contract and rounding order as `ref.rmsnorm`.

One program normalises ROWS rows of D values. With a residual, the sum x + residual is formed in
fp32 and rounded to the residual's dtype (x's, or fp32 for an fp32 residual stream), written out as
the new residual, and normalised in fp32. The normalised value is rounded to x's dtype before the weight multiply, which
is done in fp32 and rounded again, exactly as `weight * h.to(x.dtype)` does in torch. Any leading
shape is accepted; rows may have any stride, the last dim must be contiguous (it is for every caller
in the model).

With `quant` the program quantizes its output row (already rounded to x's dtype) in 1x128 groups with the fp8
GEMMs' own `quantize_tile` and stores e4m3 values and one fp32 scale per group, the scales as an [T, G] view of
[G, T] storage (the layout the fp8 GEMM loads fastest). With quant="both" (an MoE layer's norm) the scales are
row-major [T, G] instead: fused_moe's gate/up GEMM gathers rows by token, so a row's scales are
best contiguous (it was slower on the column-major ones), and the fp8 GEMM of the shared expert
takes either as fast.
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
from .ref import check_quant

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

tuning.register(
    "rmsnorm",
    "any",
    {
        # key: "d=<next pow2 of D>"; ROWS rows per program.
        "default": {"ROWS": 1, "num_warps": 4},
        "d=512": {"ROWS": 4, "num_warps": 4},
        "d=1024": {"ROWS": 2, "num_warps": 4},
        "d=2048": {"ROWS": 1, "num_warps": 4},
        "d=8192": {"ROWS": 1, "num_warps": 8},
    },
)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, plain_ptr,
    num_rows, dim, eps,
    stride_x, stride_res, stride_out, stride_res_out, stride_sm, stride_sg, stride_plain,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    QUANT: tl.constexpr, PLAIN: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the next kernel (a decode GEMM) may launch and start on its weights
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if PDL:  # launched early (launch_pdl): the weight is a parameter; x waits for the kernel before
        gdc_wait()
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        if row < num_rows:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + offs_d, mask=mask_d, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row64 * stride_res + offs_d, mask=mask_d, other=0.0)
                s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_ptr + row64 * stride_res_out + offs_d, s, mask=mask_d)
                h = s.to(tl.float32)
            else:
                h = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
            h = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            out = (w * h).to(x_ptr.dtype.element_ty)
            if QUANT:
                if PLAIN:  # the output in x's dtype as well (quant="both")
                    tl.store(plain_ptr + row64 * stride_plain + offs_d, out, mask=mask_d)
                groups = tl.reshape(out.to(tl.float32), [BLOCK_D // GROUP, GROUP])
                q, scale = quantize_tile(groups, FP8_MAX, MIN_AMAX, EXACT_CAST)
                offs_g = tl.arange(0, BLOCK_D // GROUP)
                offs = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
                tl.store(out_ptr + row64 * stride_out + offs, q, mask=offs < dim)
                tl.store(
                    scale_ptr + row64 * stride_sm + offs_g * stride_sg,
                    scale,
                    mask=offs_g * GROUP < dim,
                )
            else:
                tl.store(out_ptr + row64 * stride_out + offs_d, out, mask=mask_d)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: bool | str = False,
):
    """x, residual: [..., D]; weight: [D]. Returns out (x's dtype and shape), or (out, x +
    residual). With `quant` (x [T, D] only), out is (out_fp8 [T, D] e4m3, scales [T, ceil(D/128)]);
    with quant="both", (out, (out_fp8, scales))."""
    check_quant(quant)
    if x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rmsnorm: x must be a float tensor [..., D], got {x.dtype} {tuple(x.shape)}"
        )
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rmsnorm: weight must be [{dim}] float, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rmsnorm: weight on {weight.device}, x on {x.device}")
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype not in (x.dtype, torch.float32)
        or residual.device != x.device
    ):
        raise ValueError(
            f"rmsnorm: residual must match x ({x.dtype} or float32, {tuple(x.shape)} on {x.device}), "
            f"got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    if quant and x.dim() != 2:
        raise ValueError(f"rmsnorm: quant needs x [T, D], got {tuple(x.shape)}")
    x2 = _rows(x)  # [N, D]
    res2 = _rows(residual) if residual is not None else x2
    weight = weight.contiguous()
    num_rows = x2.shape[0]
    plain = torch.empty_like(x, memory_format=torch.contiguous_format) if quant == "both" else None
    if quant:  # with quant="both", row-major scales (module note)
        out, scales = empty_quantized(num_rows, dim, x.device, column_major=quant != "both")
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        scales = torch.empty((1, 1), dtype=torch.float32, device=x.device)  # unread
    res_out = (
        torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else out
    )
    out2, res_out2 = out.view(-1, dim), res_out.view(-1, dim)
    result = (out, scales) if quant else out
    if plain is not None:
        result = (plain, result)
    plain2 = plain.view(-1, dim) if plain is not None else out2
    if num_rows == 0 or dim == 0:
        return result if residual is None else (result, res_out)
    block_d = triton.next_power_of_2(dim)
    cfg = tuning.lookup("rmsnorm", f"d={block_d}", x.device)
    rows = cfg["ROWS"]
    pdl = pdl_enabled(x.device)
    _rmsnorm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, res2, weight, out2, res_out2, scales, plain2,
        num_rows, dim, eps,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), *scales.stride(),
        plain2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_D=max(block_d, ACT_QUANT_GROUP) if quant else block_d, ROWS=rows,
        QUANT=bool(quant), PLAIN=plain is not None, GROUP=ACT_QUANT_GROUP, FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX,
        EXACT_CAST=interpreter_enabled(), PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl,
    )  # fmt: skip
    return result if residual is None else (result, res_out)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [N, D] with unit stride along D (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
