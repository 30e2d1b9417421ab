"""The fp8 MoE grouped GEMMs for Hopper (sm_90) in Gluon, on the warp-specialized structure of
`gluon_sm90_common` (a TMA producer warp, two consumer warpgroups of 64 rows, each scaling
one k-tile's product while the next k-tile's wgmma runs). Rows are in the layout of
`_triton_layout` (each expert's run padded to 128 rows; x already permuted and quantized), so an
M-tile belongs to one expert (`tile_experts`, built once from `ends` for both kernels); tiles
past the last run exit at once.

down: y[rows, D] = act[rows, I] @ w2[e]^T, the dense fp8 GEMM's consumers and producer with the
weight rows offset to expert e.

gate/up: act[rows, I] = silu(x @ gate[e]^T) * (x @ up[e]^T), quantized to fp8 in 1x128 groups.
A CTA owns 128 rows and 128 act columns (one quant group a row) in two passes over K: pass p loads
64 gate rows and the matching 64 up rows into one 128-row B tile, so one 128-wide wgmma gives gate
in product columns 0..63 and up in 64..127, each scaled by its own weight block's scale. Between
passes, the first half of the act tile waits in shared memory in fp32; after the second, the
row's amax over both halves gives the group's scale. Needs I % 128 == 0.
"""

from __future__ import annotations

import torch
import triton

from .._backend import num_sms
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
        warpgroup_mma,
        warpgroup_mma_wait,
    )
BLOCK_M = 128  # two consumer warpgroups of 64 rows


if IMPORTED:

    @gluon.jit
    def _down_producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr,
                       num_experts, num_pid_n, num_tiles, N, n_pad):  # fmt: skip
        """One warp: the TMA loads of every k-tile of this CTA's tiles, in the consumers' order,
        up to STAGES ahead (so the next tile's loads run under the current tile's epilogue)."""
        STAGES: gl.constexpr = b_bufs.shape[0]
        HALF: gl.constexpr = a_lo.shape[1]
        BLOCK_K: gl.constexpr = a_lo.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m = t // num_pid_n
            e = gl.load(tile_expert_ptr + pid_m)
            if e < num_experts:
                off_m = pid_m * 2 * HALF
                b_row = e * N + (t - pid_m * num_pid_n) * BLOCK_N  # rows of [E * N, K]
                for i in range(0, n_pad):
                    s = (c + i) % STAGES
                    mbarrier.wait(empty.index(s), (((c + i) // STAGES) & 1) ^ 1)
                    bar = ready.index(s)
                    mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                    tma_load(a_desc, [off_m, i * BLOCK_K], bar, a_lo.index(s))
                    tma_load(a_desc, [off_m + HALF, i * BLOCK_K], bar, a_hi.index(s))
                    tma_load(b_desc, [b_row, i * BLOCK_K], bar, b_bufs.index(s))
                c += n_pad

    @gluon.jit
    def _down_consumer(a_bufs, b_bufs, ready, empty, tile_expert_ptr, as_ptr, bs_ptr, c_desc,
                       c_smem, num_experts, num_pid_n, num_tiles, n_k, n_pad, row_off,
                       stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk):  # fmt: skip
        """One warpgroup: rows row_off..row_off+63 of each of this CTA's tiles, k-tiles in pairs
        as in fp8_gemm/gluon_sm90.py's consumer."""
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        SCALE_BLOCK: gl.constexpr = a_bufs.shape[2]
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        prod_a = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_b = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m = t // num_pid_n
            e = gl.load(tile_expert_ptr + pid_m)
            if e < num_experts:
                off_m = pid_m * 2 * BLOCK_M + row_off
                off_n = (t - pid_m * num_pid_n) * BLOCK_N
                rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
                as_ptrs = as_ptr + rows * stride_asm
                bs_tile = bs_ptr + e.to(gl.int64) * stride_bse + (off_n // SCALE_BLOCK) * stride_bsn
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
                acc, prod_a, prod_b = mma_tile(a_bufs, b_bufs, ready, empty, as_ptrs, bs_tile, acc,
                                               prod_a, prod_b, c, n_k, n_pad, stride_ask,
                                               stride_bsk)  # fmt: skip
                c += n_pad
                tma.store_wait(0)  # the previous tile's store has read c_smem
                gl.thread_barrier()
                store_tile(acc, c_desc, c_smem, off_m, off_n)
        tma.store_wait(0)

    @gluon.jit
    def _down_kernel(
        a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_expert_ptr, num_experts, M, N, K,
        stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        """Persistent: CTA p takes tiles p, p + grid, ... (M-tile major, all N-tiles of an M-tile
        in a row, so the CTAs at work share one expert's weights in L2)."""
        HALF: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_tiles = gl.cdiv(M, 2 * HALF) * num_pid_n
        n_k = gl.cdiv(K, BLOCK_K)
        n_pad = gl.cdiv(n_k, 2) * 2
        a_lo, a_hi, b_bufs, ready, empty = ring(a_desc, b_desc, STAGES, BLOCK_N)
        c_lo = gl.allocate_shared_memory(c_desc.dtype, [HALF, BLOCK_N], c_desc.layout)
        c_hi = gl.allocate_shared_memory(c_desc.dtype, [HALF, BLOCK_N], c_desc.layout)
        sched = (tile_expert_ptr, num_experts, num_pid_n, num_tiles, N)
        tail = (stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk)
        consumer = (ready, empty, tile_expert_ptr, as_ptr, bs_ptr, c_desc)
        rest = (num_experts, num_pid_n, num_tiles, n_k, n_pad)
        gl.warp_specialize(
            [
                (_down_consumer,
                 (a_lo, b_bufs) + consumer + (c_lo,) + rest + (gl.to_tensor(0),) + tail),
                (_down_consumer,
                 (a_hi, b_bufs) + consumer + (c_hi,) + rest + (gl.to_tensor(HALF),) + tail),
                (_down_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty) + sched
                 + (n_pad,)),
            ],
            [4, 1],
            [232, 40],
        )  # fmt: skip

    @gluon.jit
    def _gate_up_producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, off_m, gate_row,
                          up_row, n_pad):  # fmt: skip
        """Ring position j = p * n_pad + i: pass p, k-tile i; B = 64 gate rows over 64 up rows."""
        STAGES: gl.constexpr = b_bufs.shape[0]
        HALF: gl.constexpr = a_lo.shape[1]
        BLOCK_K: gl.constexpr = a_lo.shape[2]
        HALF_N: gl.constexpr = b_desc.block_type.shape[0]
        for j in range(0, 2 * n_pad):
            s = j % STAGES
            p = j // n_pad
            k = (j - p * n_pad) * BLOCK_K
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
            tma_load(a_desc, [off_m, k], bar, a_lo.index(s))
            tma_load(a_desc, [off_m + HALF, k], bar, a_hi.index(s))
            b = b_bufs.index(s)
            tma_load(b_desc, [gate_row + p * HALF_N, k], bar, b.slice(0, HALF_N))
            tma_load(b_desc, [up_row + p * HALF_N, k], bar, b.slice(HALF_N, HALF_N))

    @gluon.jit
    def _gate_up_consumer(a_bufs, b_bufs, ready, empty, keep, as_ptr, gs_ptr, us_ptr, act_ptr,
                          acts_ptr, n_k, n_pad, off_m, off_n, pid_n, stride_asm, stride_ask,
                          stride_bsk, stride_am, stride_acm, stride_acg):  # fmt: skip
        """One warpgroup: 64 rows, two passes of 64 act columns each, then the quantization."""
        STAGES: gl.constexpr = b_bufs.shape[0]
        BLOCK_N: gl.constexpr = b_bufs.shape[1]  # 64 gate + 64 up
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        HALF_N: gl.constexpr = BLOCK_N // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        out: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        as_ptrs = as_ptr + rows * stride_asm
        is_gate = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma)) < HALF_N
        prod_a = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prod_b = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        for p in gl.static_range(2):
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            for i in range(0, n_pad, 2):
                j = p * n_pad + i
                s0 = j % STAGES
                mbarrier.wait(ready.index(s0), (j // STAGES) & 1)
                prod_a = warpgroup_mma(a_bufs.index(s0), b_bufs.index(s0).permute((1, 0)), prod_a,
                                       use_acc=False, is_async=True)  # fmt: skip
                k0 = gl.minimum(i, n_k - 1)
                a_s0 = gl.load(as_ptrs + k0 * stride_ask)
                b_s0 = gl.where(is_gate, gl.load(gs_ptr + k0 * stride_bsk),
                                gl.load(us_ptr + k0 * stride_bsk))  # fmt: skip
                s1 = (j + 1) % STAGES
                mbarrier.wait(ready.index(s1), ((j + 1) // STAGES) & 1)
                prod_b = warpgroup_mma(a_bufs.index(s1), b_bufs.index(s1).permute((1, 0)), prod_b,
                                       use_acc=False, is_async=True)  # fmt: skip
                k1 = gl.minimum(i + 1, n_k - 1)
                a_s1 = gl.load(as_ptrs + k1 * stride_ask)
                b_s1 = gl.where(is_gate, gl.load(gs_ptr + k1 * stride_bsk),
                                gl.load(us_ptr + k1 * stride_bsk))  # fmt: skip
                prod_a = warpgroup_mma_wait(num_outstanding=1, deps=(prod_a,))
                mbarrier.arrive(empty.index(s0), count=1)
                acc += prod_a * (a_s0[:, None] * b_s0[None, :])
                prod_b = warpgroup_mma_wait(num_outstanding=0, deps=(prod_b,))
                mbarrier.arrive(empty.index(s1), count=1)
                acc += prod_b * (a_s1[:, None] * b_s1[None, :])
            gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, HALF_N]), [0, 2, 1]))
            act = gl.convert_layout(gate / (1.0 + gl.exp(-gate)) * up, out)
            if p == 0:
                keep.store(act)
        first = keep.load(out)
        amax = gl.maximum(gl.max(gl.abs(first), axis=1), gl.max(gl.abs(act), axis=1))
        scale = gl.div_rn(gl.maximum(amax, 1e-12), 448.0)
        out_m = (off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out))).to(gl.int64)
        out_n = off_n + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, out))
        ptrs = act_ptr + out_m[:, None] * stride_am + out_n[None, :]
        for half in gl.static_range(2):
            x = first if half == 0 else act
            q = gl.minimum(gl.maximum(gl.div_rn(x, scale[:, None]), -448.0), 448.0)
            gl.store(ptrs + half * HALF_N, q.to(gl.float8e4nv))
        gl.store(acts_ptr + out_m * stride_acm + pid_n * stride_acg, scale)

    @gluon.jit
    def _gate_up_kernel(
        a_desc, b_desc, as_ptr, ws_ptr, act_ptr, acts_ptr, tile_expert_ptr, num_experts, M, K, inter,
        stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_am, stride_acm,
        stride_acg,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        HALF: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        HALF_N: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = 2 * HALF_N  # act columns of the CTA, one quant group
        pid_m, pid_n = tile_of(gl.program_id(0), gl.cdiv(M, 2 * HALF), inter // BLOCK_N, GROUP_M)
        off_m = pid_m * 2 * HALF
        off_n = pid_n * BLOCK_N
        e = gl.load(tile_expert_ptr + pid_m)
        if e < num_experts:
            n_k = gl.cdiv(K, BLOCK_K)
            n_pad = gl.cdiv(n_k, 2) * 2
            a_lo, a_hi, b_bufs, ready, empty = ring(a_desc, b_desc, STAGES, BLOCK_N)
            keep_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            keep_lo = gl.allocate_shared_memory(gl.float32, [HALF, HALF_N], keep_layout)
            keep_hi = gl.allocate_shared_memory(gl.float32, [HALF, HALF_N], keep_layout)
            ws_e = ws_ptr + e.to(gl.int64) * stride_wse
            gs_ptr = ws_e + (off_n // BLOCK_K) * stride_wsn
            us_ptr = ws_e + ((inter + off_n) // BLOCK_K) * stride_wsn
            gate_row = e * 2 * inter + off_n  # in the [E * 2I, D] view of w13
            up_row = gate_row + inter
            tail = (as_ptr, gs_ptr, us_ptr, act_ptr, acts_ptr, n_k, n_pad)
            strides = (stride_asm, stride_ask, stride_wsk, stride_am, stride_acm, stride_acg)
            gl.warp_specialize(
                [
                    (
                        _gate_up_consumer,
                        (a_lo, b_bufs, ready, empty, keep_lo) + tail + (off_m, off_n, pid_n)
                        + strides,
                    ),
                    (
                        _gate_up_consumer,
                        (a_hi, b_bufs, ready, empty, keep_hi) + tail
                        + (off_m + HALF, off_n, pid_n) + strides,
                    ),
                    (
                        _gate_up_producer,
                        (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, off_m, gate_row,
                         up_row, n_pad),
                    ),
                ],
                [4, 1],
                [232, 40],
            )  # fmt: skip


def usable(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cfg: dict) -> bool:
    """Whether the Gluon path takes this fp8 call: asked for (`gluon` in cfg), an sm_90 GPU,
    BLOCK_M 128, I a multiple of 128 and rows that TMA can read. cfg's `gluon_stages` (gate/up,
    down; default 4, 4) sizes the rings; BLOCK_N2 (dividing 128) the down GEMM's tile."""
    inter = w2.shape[2]
    return (
        bool(cfg.get("gluon"))
        and available(x_in.device)
        and cfg["BLOCK_M"] == BLOCK_M
        and inter % 128 == 0
        and 128 % cfg["BLOCK_N2"] == 0
        and x_in.shape[1] % 16 == 0
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def tile_experts(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each 128-row M-tile of the row layout (num_experts past the last run)."""
    tile_starts = torch.arange(0, rows, BLOCK_M, device=ends.device, dtype=torch.int32)
    return torch.searchsorted(ends, tile_starts, right=True, out_int32=True)


def _desc(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor.from_tensor(t, block, layout)


def gate_up(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    w13: torch.Tensor,
    w13_s: torch.Tensor,
    act: torch.Tensor,
    act_scales: torch.Tensor,
    tile_expert: torch.Tensor,
    cfg: dict,
) -> None:
    """act, act_scales = quant(silu(x @ gate^T) * (x @ up^T)) over the row layout (x permuted)."""
    rows, hidden = x_fp8.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    a_desc = _desc(x_fp8, [BLOCK_M // 2, 128])
    b_desc = _desc(w13.view(-1, hidden), [64, 128])
    grid = ((rows // BLOCK_M) * (inter // 128),)
    _gate_up_kernel[grid](
        a_desc, b_desc, x_scales, w13_s, act, act_scales, tile_expert, num_experts, rows, hidden,
        inter,
        x_scales.stride(0), x_scales.stride(1), *w13_s.stride(), act.stride(0),
        act_scales.stride(0), act_scales.stride(1),
        GROUP_M=cfg["GROUP_M"], STAGES=cfg.get("gluon_stages", (4, 4))[0],
        num_warps=4,
    )  # fmt: skip


def down(
    act: torch.Tensor,
    act_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_s: torch.Tensor,
    y: torch.Tensor,
    tile_expert: torch.Tensor,
    cfg: dict,
) -> None:
    """y = act @ w2[expert of the row]^T over the row layout."""
    rows, inter = act.shape
    num_experts, hidden = w2.shape[:2]
    block_n = cfg["BLOCK_N2"]
    a_desc = _desc(act, [BLOCK_M // 2, 128])
    b_desc = _desc(w2.view(-1, inter), [block_n, 128])
    tiles = (rows // BLOCK_M) * triton.cdiv(hidden, block_n)
    grid = (min(tiles, num_sms(act.device)),)
    c_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, block_n], GL_DTYPE[y.dtype])
    c_desc = TensorDescriptor.from_tensor(y, [BLOCK_M // 2, block_n], c_layout)
    _down_kernel[grid](
        a_desc, b_desc, c_desc, act_scales, w2_s, tile_expert, num_experts, rows, hidden, inter,
        act_scales.stride(0), act_scales.stride(1), *w2_s.stride(),
        STAGES=cfg.get("gluon_stages", (4, 4))[1], num_warps=4,
    )  # fmt: skip
