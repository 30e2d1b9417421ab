"""Building blocks of the warp-specialized Gluon kernels for Hopper (sm_90), shared by fp8_gemm,
fused_moe and mla_decode: Gluon's imports (under the names the kernels use, whatever the Triton
version calls them), `available()`, and the pieces of the fp8 GEMMs' structure, a TMA producer
warp feeding a shared-memory ring that two consumer warpgroups of 64 rows each drain with wgmma:

- `ring`: the ring's slots and its `ready` / `empty` mbarriers;
- `mma_tile`: a consumer's scaled k-tile loop (acc += (A_k @ B_k^T) * a_scale_k * b_scale_k), the
  k-tiles in pairs: both wgmmas issued, the first product scaled while the second runs. The pairs
  are the loop's step because ptxas serializes every wgmma of a kernel when a wgmma in flight on
  one register set crosses a loop back-edge while the other set is read (its note C7514), so
  every pair ends fully waited and K is padded to whole pairs (a k-tile past K reads zeros);
- `store_tile`: a consumer's output tile out through shared memory and a TMA store.

Gluon needs Triton >= 3.6 with Hopper wgmma and warp specialization: where it does not import
(`IMPORTED` False, e.g. an older Triton), nothing but `IMPORTED`, `GL_DTYPE` (empty) and
`available` (False) is defined, and the kernels built on this module are never launched.
"""

from __future__ import annotations

import torch

from ._backend import capability

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load's name: async_copy_global_to_shared in Triton 3.6, async_load from 3.7 or so
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    IMPORTED = True
except ImportError:  # older Triton: no Gluon, or no Hopper wgmma in it
    IMPORTED = False


GL_DTYPE = (
    {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    if IMPORTED
    else {}
)
"""Gluon's dtype of a torch float dtype (for shared-memory layouts of TMA descriptors)."""


def available(device: torch.device) -> bool:
    """Gluon imports and `device` is an sm_90 GPU (Hopper)."""
    return IMPORTED and device.type == "cuda" and capability(device.index) == (9, 0)


if IMPORTED:

    @gluon.jit
    def ring(a_desc, b_desc, STAGES: gl.constexpr, B_ROWS: gl.constexpr):
        """The shared-memory ring of the warp-specialized kernels: per slot, A as two 64-row halves
        (one per consumer), a B tile of B_ROWS rows, and `ready` (count 1: the TMA) / `empty`
        (count 2: one arrival per consumer) mbarriers. Returns (a_lo, a_hi, b_bufs, ready, empty)."""
        HALF: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        a_lo = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BLOCK_K], a_desc.layout)
        a_hi = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)
            mbarrier.init(empty.index(slot), count=2)
        return a_lo, a_hi, b_bufs, ready, empty

    @gluon.jit
    def scale_of(as_ptrs, bs_ptr, kt, stride_ask, stride_bsk):
        """a_scale[rows, kt] * b_scale[tile's block, kt]: the k-tile's scale per accumulator row."""
        return gl.load(as_ptrs + kt * stride_ask) * gl.load(bs_ptr + kt * stride_bsk)

    @gluon.jit
    def mma_tile(a_bufs, b_bufs, ready, empty, as_ptrs, bs_tile, acc, prod_a, prod_b, c, n_k,
                 n_pad, stride_ask, stride_bsk):  # fmt: skip
        """acc += the scaled products of one tile's n_pad k-tiles, whose ring positions start at c:
        per pair, both wgmmas issued, the first product scaled while the second runs, then the
        second; every pair ends fully waited (see the module note on ptxas). Returns
        (acc, prod_a, prod_b)."""
        STAGES: gl.constexpr = b_bufs.shape[0]
        for i in range(0, n_pad, 2):
            s0 = (c + i) % STAGES
            mbarrier.wait(ready.index(s0), ((c + i) // STAGES) & 1)
            prod_a = warpgroup_mma(a_bufs.index(s0), b_bufs.index(s0).permute((1, 0)), prod_a,
                                   use_acc=False, is_async=True)  # fmt: skip
            scale_a = scale_of(as_ptrs, bs_tile, gl.minimum(i, n_k - 1), stride_ask, stride_bsk)
            s1 = (c + i + 1) % STAGES
            mbarrier.wait(ready.index(s1), ((c + i + 1) // STAGES) & 1)
            prod_b = warpgroup_mma(a_bufs.index(s1), b_bufs.index(s1).permute((1, 0)), prod_b,
                                   use_acc=False, is_async=True)  # fmt: skip
            scale_b = scale_of(as_ptrs, bs_tile, gl.minimum(i + 1, n_k - 1), stride_ask, stride_bsk)
            prod_a = warpgroup_mma_wait(num_outstanding=1, deps=(prod_a,))
            mbarrier.arrive(empty.index(s0), count=1)
            acc += prod_a * scale_a[:, None]
            prod_b = warpgroup_mma_wait(num_outstanding=0, deps=(prod_b,))
            mbarrier.arrive(empty.index(s1), count=1)
            acc += prod_b * scale_b[:, None]
        return acc, prod_a, prod_b

    @gluon.jit
    def store_tile(acc, c_desc, c_smem, off_m, off_n):
        """A consumer's output tile out through shared memory and a TMA store (which clips rows
        past M and columns past N), left in flight: tma.store_wait before c_smem is written
        again."""
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma_store(c_desc, [off_m, off_n], c_smem)


__all__ = [
    "GL_DTYPE",
    "IMPORTED",
    "TensorDescriptor",
    "available",
    "fence_async_shared",
    "gl",
    "gluon",
    "mbarrier",
    "mma_tile",
    "ring",
    "scale_of",
    "store_tile",
    "tma",
    "tma_load",
    "tma_store",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
