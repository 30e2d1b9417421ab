"""Dense matmuls of the model, in plain torch (cuBLAS on a GPU): the spec of the Triton kernels.

`linear(x, w, out_dtype=None)`: x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (w must have x's dtype), or in
`out_dtype` float32 from bf16/fp16 operands: the products are exact in fp32 and summed in fp32 (the MoE router's
logits; on a GPU one cuBLAS GEMM with an fp32 output, on the CPU the operands upcast).
`head_matmul(x, w)`: per head h, x[:, h] @ w[h]: x [T, H, K], w [H, K, N] (any strides) -> [T, H, N]. With
`quant=True` (N a multiple of 128) that product, in x's dtype, comes quantized for an fp8 projection:
`fp8_gemm.quantize_act` of it as [T, H * N], i.e. (out_fp8 [T, H * N], scales [T, H * N / 128]). Unquantized,
`out` (a [T, H, N] tensor of x's dtype, any strides with the last one 1, e.g. the first N columns of a wider
buffer) receives the product and is returned: the absorbed-MLA query is written this way next to its rope part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_quant import ACT_QUANT_GROUP, quantize_act


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if check_out_dtype(x, w, out_dtype) is None:
        return F.linear(x, w)
    if not x.is_cuda:
        return F.linear(x.float(), w.float())
    out = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
    return out.view(*x.shape[:-1], w.shape[0])


def check_out_dtype(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None
) -> torch.dtype | None:
    """linear's out_dtype: None (or x's dtype) for x's dtype, which it returns as None; else it must be float32
    with x and w one 16-bit float dtype."""
    if out_dtype is None or out_dtype == x.dtype:
        return None
    if (
        out_dtype != torch.float32
        or x.dtype not in (torch.bfloat16, torch.float16)
        or w.dtype != x.dtype
    ):
        raise ValueError(
            f"linear: out_dtype {out_dtype} needs float32 from x and w of one 16-bit float dtype, "
            f"got x {x.dtype}, w {w.dtype}"
        )
    return out_dtype


def head_matmul(
    x: torch.Tensor, w: torch.Tensor, quant: bool = False, out: torch.Tensor | None = None
):
    if out is not None:
        check_head_out(x, w, quant, out)
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out
    out = torch.einsum("thk,hkn->thn", x, w)
    if not quant:
        return out
    if out.shape[-1] % ACT_QUANT_GROUP:
        raise ValueError(
            f"head_matmul: quant needs N a multiple of {ACT_QUANT_GROUP}, got {out.shape[-1]}"
        )
    return quantize_act(out.reshape(out.shape[0], -1))


def check_head_out(x: torch.Tensor, w: torch.Tensor, quant: bool, out: torch.Tensor) -> None:
    """head_matmul's `out`: refused with quant, or unless it is [T, H, N] of x's dtype and device with unit
    stride along N."""
    if quant:
        raise ValueError("head_matmul: out= is for the unquantized product")
    shape = (x.shape[0], x.shape[1], w.shape[-1])
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"head_matmul: out must be {shape} {x.dtype} on {x.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"head_matmul: out's last stride must be 1, got {out.stride()}")
