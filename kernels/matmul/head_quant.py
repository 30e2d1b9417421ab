"""The per-head product with its output quantized for an fp8 projection, in Triton.

`head_matmul(x, w, quant=True)`: out[t, h] = x[t, h] @ w[h], rounded to x's dtype, then quantized to e4m3
in 1x128 groups along the flattened [T, H * N] row, as `fp8_gemm.quantize_act` would quantize
`out.reshape(T, H * N)`. With N a multiple of 128 no group spans two heads, so each program of the
matmul kernel (triton.py, its QUANT epilogue) computes BLOCK_M rows x 128 columns of one head and
quantizes its own tile. In the absorbed MLA decode this is W_UV's product (N = v_head_dim = 128),
whose quantized output feeds the fp8 o projection directly.
No split of K: a row's result does not depend on the batch (batch-invariant as it stands).
"""

from __future__ import annotations

import torch
import triton

from .. import tuning
from .._backend import interpreter_enabled
from ..fp8_quant import ACT_QUANT_GROUP, FP8_E4M3_MAX, MIN_AMAX
from ..fp8_quant_triton import empty_quantized
from .triton import _matmul_kernel

tuning.register(
    "head_matmul_quant",
    "any",
    {
        # key: "m<=16" / "m<=32" / "default" by rows T
        "m<=16": {"BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        "m<=32": {"BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        "default": {"BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    },
)


def head_matmul_quant(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, K], w [H, K, N] (any strides; N a multiple of 128) -> (out_fp8 [T, H * N] e4m3,
    scales [T, H * N / 128] fp32, an [T, G] view of [G, T] storage)."""
    t, h, k = x.shape
    n = w.shape[2]
    if n % ACT_QUANT_GROUP:
        raise ValueError(f"head_matmul: quant needs N a multiple of {ACT_QUANT_GROUP}, got {n}")
    q, scales = empty_quantized(t, h * n, x.device)
    if t == 0 or h == 0:
        return q, scales
    key = "m<=16" if t <= 16 else "m<=32" if t <= 32 else "default"
    cfg = tuning.lookup("head_matmul_quant", key, x.device)
    grid = (triton.cdiv(t, cfg["BLOCK_M"]) * (n // ACT_QUANT_GROUP), 1, h)
    # the matmul kernel's QUANT epilogue; out viewed as [H, T, N] (column h * N + n of row t)
    _matmul_kernel[grid](
        x, w, q, t, n, k, k,
        x.stride(1), x.stride(0), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        0, n, q.stride(0), 1,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=ACT_QUANT_GROUP, BLOCK_K=cfg["BLOCK_K"], GROUP_M=1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        s_ptr=scales, stride_sm=scales.stride(0), stride_sg=scales.stride(1), QUANT=True,
        FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX, EXACT_CAST=interpreter_enabled(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return q, scales
