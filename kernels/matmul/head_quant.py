"""The per-head product with its output quantized for an fp8 projection, in Triton.

`head_matmul(x, w, quant=True)`: out[t, h] = x[t, h] @ w[h], rounded to x's dtype, then quantized to e4m3
in 1x128 groups along the flattened [T, H * N] row, as `fp8_gemm.quantize_act` would quantize
`out.reshape(T, H * N)`. With N a multiple of 128 no group spans two heads, so each program computes
BLOCK_M rows x 128 columns of one head and quantizes its own tile. In the absorbed MLA decode this is
W_UV's product (N = v_head_dim = 128), whose quantized output feeds the fp8 o projection directly.
No split of K: a row's result does not depend on the batch (batch-invariant as it stands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from .._backend import interpreter_enabled
from ..fp8_gemm._quant import quantize_tile
from ..fp8_gemm.ref import _MIN_AMAX, ACT_QUANT_GROUP, FP8_E4M3_MAX

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


@triton.jit
def _head_matmul_quant_kernel(
    a_ptr, b_ptr, q_ptr, s_ptr, M, K, N,
    stride_am, stride_ah, stride_ak, stride_bh, stride_bk, stride_bn, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * GROUP + tl.arange(0, GROUP)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    rows = offs_m.to(tl.int64)[:, None]
    a_ptrs = a_ptr + h * stride_ah + rows * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + h * stride_bh
        + offs_k.to(tl.int64)[:, None] * stride_bk
        + offs_n[None, :] * stride_bn
    )
    acc = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    # the value the unquantized product would hand on, then its quantization
    out = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    q, scale = quantize_tile(out, FP8_MAX, MIN_AMAX, EXACT_CAST)
    cols = h * N + offs_n
    tl.store(q_ptr + rows * stride_qm + cols[None, :], q, mask=m_ok[:, None])
    group = (h * N) // GROUP + pid_n
    tl.store(s_ptr + offs_m * stride_sm + group * stride_sg, scale, mask=m_ok)


def head_matmul_quant(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, K], w [H, K, N] (any strides; N a multiple of 128) -> (out_fp8 [T, H * N] e4m3,
    scales [T, H * N / 128] fp32, an [T, G] view of [G, T] storage)."""
    t, h, k = x.shape
    n = w.shape[2]
    if n % ACT_QUANT_GROUP:
        raise ValueError(f"head_matmul: quant needs N a multiple of {ACT_QUANT_GROUP}, got {n}")
    q = torch.empty((t, h * n), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((h * n // ACT_QUANT_GROUP, t), dtype=torch.float32, device=x.device).t()
    if t == 0 or h == 0:
        return q, scales
    key = "m<=16" if t <= 16 else "m<=32" if t <= 32 else "default"
    cfg = tuning.lookup("head_matmul_quant", key, x.device)
    grid = (triton.cdiv(t, cfg["BLOCK_M"]), n // ACT_QUANT_GROUP, h)
    _head_matmul_quant_kernel[grid](
        x, w, q, scales, t, k, n,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        q.stride(0), scales.stride(0), scales.stride(1),
        GROUP=ACT_QUANT_GROUP, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=_MIN_AMAX, EXACT_CAST=interpreter_enabled(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return q, scales
