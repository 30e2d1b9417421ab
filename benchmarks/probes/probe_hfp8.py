# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Per-head GEMM with fp8 weights (128x128 block scales) against cuBLAS bf16, absorbed-MLA shapes, 128 heads.
CUDA graph of 20, median, us per call."""

import torch
import triton
import triton.language as tl
from _common import graph_us


@triton.jit
def _k(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    M,
    K,
    sx_t,
    sx_h,
    sw_h,
    sw_k,
    sw_n,
    ss_h,
    ss_k,
    ss_n,
    so_t,
    so_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(
            x_ptr + offs_m[:, None] * sx_t + h * sx_h + (kb * BLOCK_K + offs_k)[None, :],
            mask=offs_m[:, None] < M,
            other=0.0,
        )
        b = tl.load(
            w_ptr + h * sw_h + (kb * BLOCK_K + offs_k)[:, None] * sw_k + offs_n[None, :] * sw_n
        )
        sc = tl.load(s_ptr + h * ss_h + kb * ss_k + ((pid_n * BLOCK_N) // 128) * ss_n)
        acc += tl.dot(a, b.to(tl.bfloat16)) * sc
    tl.store(
        o_ptr + offs_m[:, None] * so_t + h * so_h + offs_n[None, :],
        acc.to(tl.bfloat16),
        mask=offs_m[:, None] < M,
    )


def run(x, w8, s, block_n, block_m=16, warps=4, stages=3):
    M, H, K = x.shape
    N = w8.shape[2]
    o = torch.empty(M, H, N, device=x.device, dtype=torch.bfloat16)
    _k[(N // block_n, H, triton.cdiv(M, block_m))](
        x,
        w8,
        s,
        o,
        M,
        K,
        *x.stride()[:2],
        *w8.stride(),
        *s.stride(),
        *o.stride()[:2],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128,
        num_warps=warps,
        num_stages=stages,
    )
    return o


timed = graph_us


H = 128
wkv = (torch.randn(H * 256, 512, device="cuda") * 0.05).to(
    torch.float8_e4m3fn
)  # [H*(nope+v), lora]
scale = torch.rand(H * 2, 4, device="cuda") + 0.5
w8 = wkv.view(H, 256, 512)
s3 = scale.view(H, 2, 4)
dense = (
    (wkv.float().view(H * 2, 128, 4, 128) * scale[:, None, :, None])
    .view(H, 256, 512)
    .to(torch.bfloat16)
)
for M in (1, 16, 64):
    # W_UK: x [M, H, 128] @ w[h, :128, :] ([K=128, N=512]); scales s3[h, 0, n/128] -> as [H, K/128=1, N/128=4]
    x = torch.randn(M, H, 128, device="cuda", dtype=torch.bfloat16)
    w_uk8, s_uk = w8[:, :128, :], s3[:, 0:1, :]
    ref = torch.einsum("thk,hkn->thn", x.float(), dense[:, :128].float())
    row = [
        f"M={M:3d} W_UK: cuBLAS bf16 {timed(lambda: torch.einsum('thk,hkn->thn', x, dense[:, :128])):5.1f}"
    ]
    for bn in (64, 128):
        got = run(x, w_uk8, s_uk, bn)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        row.append(
            f"fp8 BN{bn} {timed(lambda bn=bn: run(x, w_uk8, s_uk, bn)):5.1f} (err {err:.1e})"
        )
    print("  ".join(row), flush=True)
    # W_UV: lat [M, H, 512] @ w[h, 128:, :]^T ([K=512, N=128]); scales s3[h, 1, k/128] -> [H, K/128=4, N/128=1]
    lat = torch.randn(M, H, 512, device="cuda", dtype=torch.bfloat16)
    w_uv8 = w8[:, 128:, :].transpose(1, 2)
    s_uv = s3[:, 1:2, :].transpose(1, 2)
    ref = torch.einsum("thk,hkn->thn", lat.float(), dense[:, 128:].transpose(1, 2).float())
    row = [
        f"M={M:3d} W_UV: cuBLAS bf16 {timed(lambda: torch.einsum('thk,hkn->thn', lat, dense[:, 128:].transpose(1, 2))):5.1f}"
    ]
    for bn in (32, 64, 128):
        got = run(lat, w_uv8, s_uv, bn)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        row.append(
            f"fp8 BN{bn} {timed(lambda bn=bn: run(lat, w_uv8, s_uv, bn)):5.1f} (err {err:.1e})"
        )
    print("  ".join(row), flush=True)
