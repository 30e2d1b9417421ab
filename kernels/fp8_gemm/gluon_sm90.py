"""The fp8 block-scaled GEMM for Hopper (sm_90) in Gluon, Triton's explicit-layout dialect.

Why a second kernel: each 128-deep k-tile's product must be scaled before it joins the fp32
accumulator (acc += (A_k @ B_k^T) * a_scale_k * b_scale_k). Triton's `tl.dot` version therefore
waits for every k-tile's wgmma before its FMAs, and the tensor cores idle meanwhile. Here each
warpgroup has two sets of product registers and issues k-tile i's wgmma before it waits for k-tile
i-1's (wgmma_wait(1)), so the tensor cores run tile i while the warps scale tile i-1 in.

ptxas serializes every wgmma of the kernel if a wgmma in flight on one register set crosses a loop
back-edge while the other set is read (C7514), so the overlap runs inside groups of UNROLL k-tiles
(unrolled; the group ends with every wgmma waited for) and one scaling per group is not overlapped.
UNROLL = 2 is what fits 128x128 tiles in the registers (4 spills). K is padded to whole groups:
the padding k-tiles lie past K, where TMA fills zeros.

Operands come through TMA into a ring of STAGES shared-memory buffers, one mbarrier each; a buffer
is refilled once both warpgroups have waited for the wgmma that read it (a CTA barrier). A: [M, K]
e4m3 with a_scale [M, K/128]; B: [N, K] e4m3 with b_scale [N/128, K/128]; BLOCK_N divides 128, so
a tile's weight scale is one number per k-tile. Needs Triton >= 3.6 (Gluon with Hopper wgmma) and
an sm_90 GPU: `available()` says whether this process has both.
"""

from __future__ import annotations

import functools

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _IMPORTED = True
except ImportError:  # older Triton: no Gluon, or no Hopper wgmma in it
    _IMPORTED = False


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def available(device: torch.device) -> bool:
    """Gluon imports and `device` is an sm_90 GPU (Hopper)."""
    return _IMPORTED and device.type == "cuda" and _sm90(device.index)


if _IMPORTED:

    @gluon.jit
    def _load_tile(a_desc, b_desc, a_bufs, b_bufs, bars, kt, off_m, off_n, n_k,
                   STAGES: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """Starts the TMA loads of k-tile kt into its ring slot (nothing past the last k-tile)."""
        s = kt % STAGES
        bar = bars.index(s)
        live = kt < n_k
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(
            a_desc, [off_m, kt * BLOCK_K], bar, a_bufs.index(s), pred=live
        )
        tma.async_copy_global_to_shared(
            b_desc, [off_n, kt * BLOCK_K], bar, b_bufs.index(s), pred=live
        )

    @gluon.jit
    def _scale_of(as_ptrs, bs_ptr, kt, stride_ask, stride_bsk):
        """a_scale[rows, kt] * b_scale[tile's block, kt]: the k-tile's scale per accumulator row."""
        return gl.load(as_ptrs + kt * stride_ask) * gl.load(bs_ptr + kt * stride_bsk)

    @gluon.jit
    def _fp8_gemm_sm90_kernel(
        a_desc, b_desc, as_ptr, bs_ptr, c_ptr, M, N, K,
        stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALE_BLOCK: gl.constexpr, UNROLL: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        # The program's output tile: GROUP_M M-tiles sweep N together (L2 reuse of B).
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        group_size = GROUP_M * gl.cdiv(N, BLOCK_N)
        first_m = (pid // group_size) * GROUP_M
        rows_in_group = gl.minimum(num_pid_m - first_m, GROUP_M)
        off_m = (first_m + (pid % group_size) % rows_in_group) * BLOCK_M
        off_n = ((pid % group_size) // rows_in_group) * BLOCK_N
        n_k = gl.cdiv(K, BLOCK_K)
        n_pad = gl.cdiv(n_k, UNROLL) * UNROLL  # tiles past n_k read zeros (TMA fill)

        # One warpgroup per 64 rows; the instruction is m64 n=BLOCK_N k32 (fp8).
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma)

        a_bufs = gl.allocate_shared_memory(
            a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout
        )
        b_bufs = gl.allocate_shared_memory(
            b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout
        )
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(bars.index(slot), count=1)
        for kt in gl.static_range(STAGES):
            _load_tile(
                a_desc, b_desc, a_bufs, b_bufs, bars, kt, off_m, off_n, n_pad, STAGES, BLOCK_K
            )

        rows = gl.minimum(off_m + gl.arange(0, BLOCK_M, layout=row_layout), M - 1)
        as_ptrs = as_ptr + rows * stride_asm
        bs_tile = bs_ptr + (off_n // SCALE_BLOCK) * stride_bsn

        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_a = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_b = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        scale_prev = gl.zeros((BLOCK_M,), gl.float32, row_layout)  # set before its first use

        # Groups of UNROLL k-tiles (past K the TMA reads zeros): in a group, tile u's wgmma is
        # issued before tile u-1's product is scaled into acc; a group ends with all waited.
        for g in range(0, n_pad // UNROLL):
            for u in gl.static_range(UNROLL):
                i = g * UNROLL + u
                s = i % STAGES
                mbarrier.wait(bars.index(s), (i // STAGES) & 1)
                if u % 2 == 0:
                    prod_a = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), prod_a,
                                           use_acc=False, is_async=True)  # fmt: skip
                else:
                    prod_b = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), prod_b,
                                           use_acc=False, is_async=True)  # fmt: skip
                scale_cur = _scale_of(
                    as_ptrs, bs_tile, gl.minimum(i, n_k - 1), stride_ask, stride_bsk
                )
                if u > 0:
                    if u % 2 == 0:
                        prod_b = warpgroup_mma_wait(num_outstanding=1, deps=(prod_b,))
                        acc += prod_b * scale_prev[:, None]
                    else:
                        prod_a = warpgroup_mma_wait(num_outstanding=1, deps=(prod_a,))
                        acc += prod_a * scale_prev[:, None]
                    gl.thread_barrier()  # both warpgroups are done with k-tile i-1's slot
                    _load_tile(a_desc, b_desc, a_bufs, b_bufs, bars, i - 1 + STAGES, off_m, off_n,
                               n_pad, STAGES, BLOCK_K)  # fmt: skip
                scale_prev = scale_cur
            if (UNROLL - 1) % 2 == 0:
                prod_a = warpgroup_mma_wait(num_outstanding=0, deps=(prod_a,))
                acc += prod_a * scale_prev[:, None]
            else:
                prod_b = warpgroup_mma_wait(num_outstanding=0, deps=(prod_b,))
                acc += prod_b * scale_prev[:, None]
            gl.thread_barrier()
            _load_tile(a_desc, b_desc, a_bufs, b_bufs, bars, g * UNROLL + UNROLL - 1 + STAGES,
                       off_m, off_n, n_pad, STAGES, BLOCK_K)  # fmt: skip
        for slot in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(slot))

        out_m = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
        out_n = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
        c_ptrs = c_ptr + out_m.to(gl.int64)[:, None] * stride_cm + out_n[None, :] * stride_cn
        mask = (out_m < M)[:, None] & (out_n < N)[None, :]
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def launch(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
    scale_block: int,
) -> None:
    """out = (a * a_scales) @ (w_fp8 * w_scale_inv)^T on an sm_90 GPU; a and w_fp8 must suit TMA
    (16-byte aligned rows). cfg: BLOCK_M (64 per 4 warps), BLOCK_N (divides 128), GROUP_M,
    num_stages, num_warps."""
    m, k = a.shape
    n = w_fp8.shape[0]
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], scale_block
    if scale_block % block_n or block_m != 16 * cfg["num_warps"]:
        raise ValueError(f"gluon fp8_gemm config {cfg}: BLOCK_N must divide {scale_block}, "
                         "BLOCK_M must be 16 x num_warps")  # fmt: skip
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(w_fp8, [block_n, block_k], b_layout)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_sm90_kernel[grid](
        a_desc, b_desc, a_scales, w_scale_inv, out, m, n, k,
        a_scales.stride(0), a_scales.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        STAGES=cfg["num_stages"], SCALE_BLOCK=scale_block, UNROLL=cfg.get("unroll", 2),
        num_warps=cfg["num_warps"],
    )  # fmt: skip
