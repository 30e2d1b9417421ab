"""FP8 block-scaled GEMM for a few activation rows (decode at batch 1-4) on the CUDA cores.

At M <= 4 the product is a stream of the weight's bytes with a handful of FMAs per byte, so it
needs no tensor cores: each program loads a [BLOCK_N, GROUPS * 128] weight tile straight into
registers (16-byte loads, no shared memory, so many programs fit on an SM and keep many loads in
flight), converts it to fp32 and reduces each 128-deep group against the quantized activation
row. The arithmetic is the one `ref.fp8_gemm` and the MMA kernels do: the activation quantized in
1x128 groups (inside the kernel, or given), each group's fp8 x fp8 products summed in fp32 (exact
products; the tensor cores' sum keeps fewer bits) and scaled by a_scale[m, g] * w_scale[n // 128,
g] into the fp32 accumulator. K is split across programs when N alone gives too few of them; the
splits' fp32 partial sums are then added by the last program of each tile (`_splitk.py`).
With PDL (cfg "pdl" and `_backend.pdl_enabled`), each program loads its first weight tile, then
waits for the kernel before it (`gdc_wait`) before it reads x or stores anything: at decode
sizes the weight's first load then overlaps that kernel's tail instead of following it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._backend import interpreter_enabled, pdl_enabled
from ..fp8_quant_triton import quantize_tile
from . import _splitk

GEMV_GROUP = 128


@triton.jit
def _step_mask(kt, kt1, K, offs_g, offs_k, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """Which groups of the step starting at group kt belong to the split ([G]), and which of
    their elements lie inside K ([G, GROUP])."""
    in_split = kt + offs_g < kt1
    k_ok = in_split[:, None]
    if not EVEN_K:
        k_ok = k_ok & (kt * GROUP + offs_k < K)
    return in_split, k_ok


@triton.jit
def _fp8_gemv_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, out_ptr, cnt_ptr,
    M, N, K, k_tiles_per_split, num_splits,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cs, stride_cm, stride_cn, stride_om, stride_on,
    QUANT_A: tl.constexpr, EVEN_K: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """C[split, m, n] = sum over this split's groups g of a_scale[m, g] * w_scale[n // 128, g] *
    sum_j A[m, g*128 + j] * B[n, g*128 + j]. BLOCK_N divides 128: one weight scale per group."""
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped rows are masked on store
    offs_g = tl.arange(0, GROUPS)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    kt0 = split * k_tiles_per_split
    kt1 = tl.minimum(kt0 + k_tiles_per_split, tl.cdiv(K, GROUP))

    b_ptrs = (b_ptr + offs_n.to(tl.int64)[:, None, None] * stride_bn
              + (kt0 * GROUP + offs_k)[None, :, :] * stride_bk)  # fmt: skip
    bs_ptrs = bs_ptr + (pid_n * BLOCK_N // GROUP) * stride_bsn + (kt0 + offs_g) * stride_bsk
    offs_mm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1, GROUPS):
        in_split, k_ok = _step_mask(kt, kt1, K, offs_g, offs_k, GROUP, EVEN_K)
        b = tl.load(b_ptrs, mask=k_ok[None, :, :], other=0.0).to(tl.float32)  # [BN, G, 128]
        b_s = tl.load(bs_ptrs, mask=in_split, other=0.0)  # [G]
        if PDL:  # x (and our stores) wait for the kernel before; a no-op after the first step
            gdc_wait()  # (waiting in the first step only, behind a branch, was slower)
        for m in tl.static_range(BLOCK_M):
            row = tl.minimum(m, M - 1).to(tl.int64)
            a = tl.load(a_ptr + row * stride_am + (kt * GROUP + offs_k) * stride_ak, mask=k_ok,
                        other=0.0).to(tl.float32)  # fmt: skip
            if QUANT_A:
                q, a_s = quantize_tile(a, FP8_MAX, MIN_AMAX, EXACT_CAST)  # [G, 128], [G]
                a = q.to(tl.float32)
            else:
                a_s = tl.load(as_ptr + row * stride_asm + (kt + offs_g) * stride_ask,
                              mask=in_split, other=0.0)  # fmt: skip
            part = tl.sum(b * a[None, :, :], axis=2)  # [BN, G]
            row_sum = tl.sum(part * (a_s * b_s)[None, :], axis=1)  # [BN]
            acc += tl.where(offs_mm[None, :] == m, row_sum[:, None], 0.0)
        b_ptrs += GROUPS * GROUP * stride_bk
        bs_ptrs += GROUPS * stride_bsk
    if PDL:
        gdc_wait()  # every program waits before its stores, even one with no k-tile (a no-op here)
    out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = offs_mm.to(tl.int64)[None, :], out_n[:, None]
    mask = (offs_mm < M)[None, :] & (out_n < N)[:, None]
    _splitk.finish_tile(
        acc, c_ptr + rows * stride_cm + cols * stride_cn,
        out_ptr + rows * stride_om + cols * stride_on, mask,
        cnt_ptr + pid_n, split, num_splits, stride_cs, FOLD,
    )  # fmt: skip


def gemv_splits(n: int, k: int, cfg: dict) -> tuple[int, int]:
    """(splits, k-tiles per split) for N output rows and K: split K until the programs reach
    cfg["split_k_target_ctas"], each split keeping at least cfg["min_k_tiles"] groups of 128 and a
    multiple of GROUPS of them."""
    programs = triton.cdiv(n, cfg["BLOCK_N"])
    k_tiles = triton.cdiv(k, GEMV_GROUP)
    groups = cfg["GROUPS"]
    splits = 1
    if cfg.get("split_k_target_ctas"):
        wanted = triton.cdiv(cfg["split_k_target_ctas"], programs)
        splits = max(1, min(wanted, k_tiles // max(cfg["min_k_tiles"], 1)))
    per_split = triton.cdiv(triton.cdiv(k_tiles, splits), groups) * groups
    return triton.cdiv(k_tiles, per_split), per_split


def launch_gemv(
    a: torch.Tensor,
    a_scales: torch.Tensor | None,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    target: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    fold: bool,
    per_split: int,
    cfg: dict,
    fp8_max: float,
    min_amax: float,
) -> None:
    """target, counters, fold: as `_splitk.prepare` gives them (the launch adds the partials into
    `out` when fold); a_scales None quantizes a (a float type) in the kernel."""
    m, k = a.shape
    n = w_fp8.shape[0]
    block_m = triton.next_power_of_2(m)
    if block_m > cfg["max_m"] or GEMV_GROUP % cfg["BLOCK_N"]:
        raise ValueError(f"gemv: M={m} over max_m={cfg['max_m']} or BLOCK_N not dividing 128")
    splits = target.shape[0] if target.dim() == 3 else 1
    quant_a = a_scales is None
    if quant_a:
        a_scales = torch.empty((1, 1), dtype=torch.float32, device=a.device)  # unread
    stride_cs = target.stride(0) if splits > 1 else 0
    pdl = cfg.get("pdl", False) and pdl_enabled(a.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        a, a_scales, w_fp8, w_scale_inv, target, out, counters, m, n, k, per_split, splits,
        a.stride(0), a.stride(1), a_scales.stride(0), a_scales.stride(1),
        w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        stride_cs, target.stride(-2), target.stride(-1), out.stride(0), out.stride(1),
        QUANT_A=quant_a, EVEN_K=k % GEMV_GROUP == 0, FOLD=fold, BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"], GROUPS=cfg["GROUPS"], GROUP=GEMV_GROUP, FP8_MAX=fp8_max, MIN_AMAX=min_amax,
        EXACT_CAST=interpreter_enabled(), PDL=pdl, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip
