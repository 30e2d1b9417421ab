"""The fp8 block-scaled GEMM for Hopper (sm_90) in Gluon, Triton's explicit-layout dialect.

Why a second kernel: each 128-deep k-tile's product must be scaled before it joins the fp32
accumulator (acc += (A_k @ B_k^T) * a_scale_k * b_scale_k). Triton's `tl.dot` version therefore
waits for every k-tile's wgmma before its FMAs, with the tensor cores idle meanwhile, and both of
its warpgroups wait together.

Here the CTA is warp-specialized: one producer warp issues the TMA loads into a ring of STAGES
shared-memory slots (a `ready` mbarrier per slot, which the TMA completes, and an `empty` one,
which each consumer arrives at when its wgmma has read the slot), and two consumer warpgroups each
own 64 rows of the 128-row output tile. A consumer has two sets of product registers: per pair of
k-tiles it issues both wgmmas, scales the first product into the accumulator while the second
runs (wgmma_wait(1)), then the second. The consumers do not wait for each other, so one's scaling
overlaps the other's wgmmas.

The pairs are the loop's step because ptxas serializes every wgmma of a kernel when a wgmma in
flight on one register set crosses a loop back-edge while the other set is read (its note C7514);
K is padded to whole pairs with a k-tile past K, which TMA fills with zeros. A: [M, K] e4m3 with
a_scale [M, K/128]; B: [N, K] e4m3 with b_scale [N/128, K/128]; BLOCK_N divides 128, so a tile's
weight scale is one number per k-tile. Needs Triton >= 3.6 (Gluon with Hopper wgmma and warp
specialization) and an sm_90 GPU: `available()` says whether this process has both.
"""

from __future__ import annotations

import torch
import triton

from ..gluon_sm90_common import GL_DTYPE, IMPORTED, available
from ..tile_order import tile_of

if IMPORTED:
    from ..gluon_sm90_common import (
        TensorDescriptor,
        gl,
        gluon,
        mbarrier,
        mma_tile,
        ring,
        store_tile,
        tma,
        tma_load,
    )

    @gluon.jit
    def _producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, off_m, off_n, n_pad):
        """One warp: the TMA loads of k-tile i into ring slot i % STAGES (A as two 64-row halves,
        one per consumer), once both consumers have released the slot's previous k-tile."""
        STAGES: gl.constexpr = b_bufs.shape[0]
        HALF: gl.constexpr = a_lo.shape[1]
        BLOCK_K: gl.constexpr = a_lo.shape[2]
        for i in range(0, n_pad):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first round passes
            bar = ready.index(s)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [off_m, i * BLOCK_K], bar, a_lo.index(s))
            tma_load(a_desc, [off_m + HALF, i * BLOCK_K], bar, a_hi.index(s))
            tma_load(b_desc, [off_n, i * BLOCK_K], bar, b_bufs.index(s))

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_desc, c_smem, M, n_k, n_pad,
                  off_m, off_n, stride_asm, stride_ask, stride_bsn, stride_bsk):  # fmt: skip
        """One warpgroup: 64 rows of the output tile. Per pair of k-tiles it issues both wgmmas,
        scales the first product into acc while the second runs, then the second. The tile
        leaves through shared memory and a TMA store (which clips rows past M and columns past N):
        pointer stores from the wgmma layout, 4 bytes a thread, were slower."""
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        SCALE_BLOCK: gl.constexpr = a_bufs.shape[2]  # = BLOCK_K
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        rows = gl.minimum(off_m + gl.arange(0, BLOCK_M, layout=row_layout), M - 1)
        as_ptrs = as_ptr + rows * stride_asm
        bs_tile = bs_ptr + (off_n // SCALE_BLOCK) * stride_bsn
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_a = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_b = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        acc, prod_a, prod_b = mma_tile(a_bufs, b_bufs, ready, empty, as_ptrs, bs_tile, acc, prod_a,
                                       prod_b, 0, n_k, n_pad, stride_ask, stride_bsk)  # fmt: skip
        store_tile(acc, c_desc, c_smem, off_m, off_n)
        tma.store_wait(0)

    @gluon.jit
    def _fp8_gemm_sm90_kernel(
        a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
        stride_asm, stride_ask, stride_bsn, stride_bsk,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        HALF: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = 2 * HALF
        pid_m, pid_n = tile_of(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        n_k = gl.cdiv(K, BLOCK_K)
        n_pad = gl.cdiv(n_k, 2) * 2  # a k-tile past K reads zeros (TMA fill)

        a_lo, a_hi, b_bufs, ready, empty = ring(a_desc, b_desc, STAGES, BLOCK_N)
        c_lo = gl.allocate_shared_memory(c_desc.dtype, [HALF, BLOCK_N], c_desc.layout)
        c_hi = gl.allocate_shared_memory(c_desc.dtype, [HALF, BLOCK_N], c_desc.layout)
        ready_empty = (ready, empty, as_ptr, bs_ptr, c_desc)
        shared = (M, n_k, n_pad)
        strides = (stride_asm, stride_ask, stride_bsn, stride_bsk)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (a_lo, b_bufs) + ready_empty + (c_lo,) + shared + (off_m, off_n) + strides,
                ),
                (
                    _consumer,
                    (a_hi, b_bufs)
                    + ready_empty
                    + (c_hi,)
                    + shared
                    + (off_m + HALF, off_n)
                    + strides,
                ),
                (
                    _producer,
                    (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, off_m, off_n, n_pad),
                ),
            ],
            [4, 1],
            [232, 40],
        )


def launch(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
    scale_block: int,
) -> None:
    """out = (a * a_scales) @ (w_fp8 * w_scale_inv)^T on an sm_90 GPU; a, w_fp8 and out must suit
    TMA (16-byte aligned rows). cfg: BLOCK_M (128: two consumer warpgroups of 64 rows), BLOCK_N
    (dividing 128), GROUP_M, num_stages. The CTA has 4 + 4 + 1 warps whatever cfg's num_warps
    (that one is for the tl.dot kernel)."""
    m, k = a.shape
    n = w_fp8.shape[0]
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], scale_block
    if scale_block % block_n or block_m != 128:
        raise ValueError(
            f"gluon fp8_gemm config {cfg}: BLOCK_N must divide {scale_block}, BLOCK_M must be 128"
        )
    half = block_m // 2
    a_layout = gl.NVMMASharedLayout.get_default_for([half, block_k], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [half, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(w_fp8, [block_n, block_k], b_layout)
    c_layout = gl.NVMMASharedLayout.get_default_for([half, block_n], GL_DTYPE[out.dtype])
    c_desc = TensorDescriptor.from_tensor(out, [half, block_n], c_layout)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_sm90_kernel[grid](
        a_desc, b_desc, c_desc, a_scales, w_scale_inv, m, n, k,
        a_scales.stride(0), a_scales.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], num_warps=4,
    )  # fmt: skip


__all__ = ["available", "launch"]
