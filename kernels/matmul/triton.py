"""Batch-invariant dense matmul in Triton: C[g] = A[g] @ B[g] for a group of G problems (G = 1 for a
projection, G = heads for the absorbed-MLA products), fp32 accumulation, output in A's dtype.

Invariance: program (m-tile, n-tile, split, g) reduces K in BLOCK_K steps, in order, within its
split; a row's result depends on BLOCK_K, the splits of K and the MMA shape, and all three are fixed
by (dtype, forward phase, N, K, G, SM count), never by M. The phase (`kernels.forward_phase`) picks
large tiles without a split of K for prompts, and for decode steps small tiles with K split so that
one m-tile's programs come to about one per SM (decode batches would otherwise leave most SMs idle
on narrow projections); the splits' fp32 partials are summed in split order by a second kernel,
with no atomics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import tuning
from .._backend import invariant_phase, num_sms
from ..fp8_quant_triton import quantize_tile
from .ref import check_head_out, check_out_dtype


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, k_per_split,
    stride_ag, stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cs, stride_cg, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    s_ptr=None, stride_sm=0, stride_sg=0, QUANT: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0, MIN_AMAX: tl.constexpr = 1e-12, EXACT_CAST: tl.constexpr = False,
):  # fmt: skip
    """QUANT (no split of K, BLOCK_N = the 128-wide quant group, N a multiple of it): the tile, rounded
    to A's dtype, is quantized to e4m3 one row (one group) at a time into c, its scales into
    s[m, (g * N + n) / BLOCK_N] (see head_quant.py)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k0 = split * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    a_ptrs = (
        a_ptr + g * stride_ag + offs_m.to(tl.int64)[:, None] * stride_am
        + (k0 + offs_k)[None, :] * stride_ak
    )  # fmt: skip
    b_ptrs = (
        b_ptr + g * stride_bg + (k0 + offs_k).to(tl.int64)[:, None] * stride_bk
        + offs_n[None, :] * stride_bn
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = offs_k < k_end - k
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = (
        c_ptr + split * stride_cs + g * stride_cg + offs_m.to(tl.int64)[:, None] * stride_cm
        + offs_n[None, :] * stride_cn
    )  # fmt: skip
    if QUANT:
        # the value the unquantized product would hand on, then its quantization
        out = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
        q, scale = quantize_tile(out, FP8_MAX, MIN_AMAX, EXACT_CAST)
        tl.store(c_ptrs, q, mask=m_ok[:, None] & n_ok[None, :])
        group = (g * N) // BLOCK_N + pid_n
        tl.store(s_ptr + offs_m * stride_sm + group * stride_sg, scale, mask=m_ok)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr, c_ptr, numel, num_splits, M, N,
    stride_cg, stride_cm, stride_cn,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """c = sum over splits of part [S, G, M, N] fp32 (contiguous), in split order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    n = offs % N
    m = (offs // N) % M
    g = offs // (M * N)
    tl.store(c_ptr + g * stride_cg + m * stride_cm + n * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=ok)  # fmt: skip


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] (see ref.linear): the tile's fp32 sum stored in out_dtype."""
    _check(x, w, "linear")
    out_dtype = check_out_dtype(x, w, out_dtype) or x.dtype
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain")
    x2 = x.reshape(-1, k)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    _matmul(x2[None], w.t()[None], out[None])
    return out.view(*x.shape[:-1], w.shape[0])


def head_matmul(
    x: torch.Tensor, w: torch.Tensor, quant: bool = False, out: torch.Tensor | None = None
):
    """x [T, H, K], w [H, K, N] -> [T, H, N] (into `out` when given), or quantized (see ref.head_matmul)."""
    _check(x, w, "head_matmul")
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain")
    if out is not None:
        check_head_out(x, w, quant, out)
    if quant:
        from .head_quant import head_matmul_quant  # it imports this module's kernel

        return head_matmul_quant(x, w)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
    _matmul(x.transpose(0, 1), w, out.transpose(0, 1))
    return out


def _check(x: torch.Tensor, w: torch.Tensor, op: str) -> None:
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: x {x.dtype} and w {w.dtype} must be one float dtype")
    if x.device != w.device:
        raise ValueError(f"{op}: x on {x.device}, w on {w.device}")


def _matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """a [G, M, K] @ b [G, K, N] -> c [G, M, N], all strided views."""
    groups, m, k = a.shape
    n = b.shape[2]
    if m == 0 or n == 0:
        return
    if k == 0:
        c.zero_()
        return
    phase = invariant_phase() or "decode"
    cfg = tuning.lookup("matmul", f"{str(a.dtype).removeprefix('torch.')},{phase}", a.device)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_splits, k_per_split = _splits(
        groups * triton.cdiv(n, block_n), triton.cdiv(k, block_k), block_k,
        cfg["MIN_K_TILES_PER_SPLIT"], num_sms(a.device),
    )  # fmt: skip
    if num_splits == 1:
        target, cs = c, (0,) + tuple(c.stride())
    else:
        target = torch.empty(num_splits, groups, m, n, dtype=torch.float32, device=a.device)
        cs = tuple(target.stride())
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), num_splits, groups)
    _matmul_kernel[grid](
        a, b, target, m, n, k, k_per_split,
        *a.stride(), *b.stride(), *cs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        numel = groups * m * n
        block = 1024
        _sum_splits_kernel[(triton.cdiv(numel, block),)](
            target, c, numel, num_splits, m, n, *c.stride(), BLOCK=block, num_warps=4
        )


@functools.lru_cache(maxsize=1024)
def _splits(
    tiles_per_m_block: int, k_tiles: int, block_k: int, min_k_tiles: int, num_sms: int
) -> tuple[int, int]:
    """(splits of K, K elements per split): enough splits that one m-block's programs fill about
    one per SM, each split keeping at least `min_k_tiles` tiles of K (0: no split)."""
    if min_k_tiles <= 0:
        return 1, k_tiles * block_k
    splits = max(1, min(num_sms // max(tiles_per_m_block, 1), k_tiles // min_k_tiles))
    tiles_per_split = triton.cdiv(k_tiles, splits)
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split * block_k
