"""MLA decode's split kernel for Hopper (sm_90) in Gluon on an fp8 cache (`kv_row_fp8` rows) under a
bf16 q: `gluon_sm90`'s kernel with the cache converted on the way. Same grid, chunking and outputs;
`gluon_sm90.launch` launches it.

On an fp8 cache the producer loads each tile's latent (e4m3), rope (bf16) and scale (fp32)
columns through three descriptors over the same rows; the latent lands in the upper half of a
bf16-sized ring slot, where the consumers convert it in place (exact, in integer ops) for both
products to read. The per-row scale is applied to S's latent part by column and to P's columns
(V = K8 * scale by row), never to the tile. The conversion is the gap to the bf16 cache's kernel:
with it left out of the loop, this kernel is at least as fast as the bf16 cache's (it reads fewer
bytes).
"""

from __future__ import annotations

from ..gluon_sm90_common import IMPORTED

if IMPORTED:
    from ..gluon_sm90_common import (
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from ._kernels import E4M3_TO_BF16_PTX
    from .gluon_sm90 import _barriers, _chunk, _finish, _producer, _softmax_tile

    @gluon.jit
    def _e4m3_to_bf16(x):
        """e4m3 values to bf16, exactly, in integer ops, four at a time: each byte's sign, exponent
        and mantissa bits moved to their bf16 places give the value times 2^-120 (subnormals
        included, since both formats then read the bits the same way), and one packed bf16
        multiply by 2^120 restores it. The conversion instructions (e4m3 -> f16 -> bf16) take one
        F2F a value instead, and made the whole kernel slower."""
        return gl.inline_asm_elementwise(
            E4M3_TO_BF16_PTX,
            "=r,=r,r",
            [x.to(gl.uint8, bitcast=True)],
            dtype=gl.bfloat16,
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def _tile_scales(k_sc, t, start, end, col_layout: gl.constexpr):
        """Tile t's fp8 scales [BLOCK_N] in col_layout: column 0 of its ring slot [BLOCK_N, W] (the
        rest is the rows' padding); 0 past `end` (a stale scale may be NaN, and P is 0 there)."""
        STAGES: gl.constexpr = k_sc.shape[0]
        BLOCK_N: gl.constexpr = k_sc.shape[1]
        W: gl.constexpr = k_sc.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [8, 1], [1, 0])
        x = k_sc.index(t % STAGES).load(layout)
        first = gl.arange(0, W, layout=gl.SliceLayout(0, layout)) == 0
        sc = gl.convert_layout(gl.sum(gl.where(first[None, :], x, 0.0), 1), col_layout)
        pos = start + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        return gl.where(pos < end, sc, 0.0)

    @gluon.jit
    def _expand(k_raw, kbf, t, ready, n_tiles, start, end):
        """Tile t's fp8 latent as bf16, in place: its ring slot is kbf.index(s) ([BLOCK_N, D]
        bf16), whose upper half the producer filled with the fp8 tile (k_raw.index(2 * s + 1)).
        Both tiles are stored in 128-byte-wide column blocks, so the bf16 columns [0, D/2) lie
        below the fp8 tile and are written first; the rest overwrite it once every thread has read
        it. Rows past `end` become zeros (a stale row's bytes may be NaN); past the last tile it
        waits for nothing and writes zeros. Ends fenced for wgmma, with every warp done."""
        STAGES: gl.constexpr = kbf.shape[0]
        BLOCK_N: gl.constexpr = kbf.shape[1]
        D: gl.constexpr = kbf.shape[2]
        CH: gl.constexpr = D // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // CH, CH // 16], [8, 1], [1, 0])
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1, pred=t < n_tiles)
        valid = end - start - t * BLOCK_N
        if t >= n_tiles:
            valid = 0
        keep = (gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)) < valid)[:, None]
        src = k_raw.index(2 * s + 1)
        dst = kbf.index(s)
        for c in gl.static_range(2):
            x = _e4m3_to_bf16(src.slice(c * CH, CH, dim=1).load(layout))
            dst.slice(c * CH, CH, dim=1).store(gl.where(keep, x, gl.zeros_like(x)))
        x2 = _e4m3_to_bf16(src.slice(2 * CH, CH, dim=1).load(layout))
        x3 = _e4m3_to_bf16(src.slice(3 * CH, CH, dim=1).load(layout))
        gl.thread_barrier()
        dst.slice(2 * CH, CH, dim=1).store(gl.where(keep, x2, gl.zeros_like(x2)))
        dst.slice(3 * CH, CH, dim=1).store(gl.where(keep, x3, gl.zeros_like(x3)))
        fence_async_shared()  # visible to wgmma, and every warp done
        gl.thread_barrier()

    @gluon.jit
    def _consumer_fp8(q_lat, q_pe, k8, k_pe, k_sc, kbf, p_smem, q_bar, ready, empty, out_ptr,
                      lse_ptr, b, pid_s, row0, num_heads, num_rows, seq_len, start, end, n_tiles,
                      qk_scale, stride_ob, stride_os, stride_oq, stride_oh,
                      stride_lb, stride_ls, stride_lq, stride_lh, NUM_Q: gl.constexpr):  # fmt: skip
        """`_consumer` on an fp8 cache. Each tile's latent is converted to bf16 in place in its
        ring slot (`_expand`), and both products read it there; its scales multiply S's latent
        part by column (S = (Q_lat K8^T) * scale + Q_pe K_pe^T) and P's columns before P V (V =
        K8 * scale by row). The next tile's conversion and scores run while P V does; a slot is
        released once its tile's P V is done."""
        STAGES: gl.constexpr = kbf.shape[0]
        BLOCK_N: gl.constexpr = kbf.shape[1]
        D_LATENT: gl.constexpr = kbf.shape[2]
        BLOCK_M: gl.constexpr = q_lat.shape[0]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_LATENT // 2, 16]
        )
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        visible = seq_len - NUM_Q + 1 + rows // num_heads  # positions < visible are seen
        offs_n = gl.arange(0, BLOCK_N, layout=col_s)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_part = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        s_lat = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        s_pe = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        acc = gl.zeros([BLOCK_M, D_LATENT], gl.float32, mma_o)
        mbarrier.wait(q_bar, 0)
        _expand(k8, kbf, 0, ready, n_tiles, start, end)
        s_pe = warpgroup_mma(q_pe, k_pe.index(0).permute((1, 0)), s_pe, use_acc=False,
                             is_async=True)  # fmt: skip
        s_lat = warpgroup_mma(q_lat, kbf.index(0).permute((1, 0)), s_lat, use_acc=False,
                              is_async=True)  # fmt: skip
        s_pe, s_lat = warpgroup_mma_wait(num_outstanding=0, deps=(s_pe, s_lat))
        for j in range(n_tiles):
            sc = _tile_scales(k_sc, j, start, end, col_s)
            pos = start + j * BLOCK_N + offs_n
            p, m_i, l_part, acc = _softmax_tile(s_lat * sc[None, :] + s_pe, pos, visible, end,
                                                m_i, l_part, acc, qk_scale, mma_o)  # fmt: skip
            gl.thread_barrier()  # both warpgroups have waited for the previous P V: P is free
            p_smem.store((p * sc[None, :]).to(p_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(p_smem, kbf.index(j % STAGES), acc, is_async=True)
            t = j + 1
            _expand(k8, kbf, t, ready, n_tiles, start, end)
            s = t % STAGES
            s_pe = warpgroup_mma(q_pe, k_pe.index(s).permute((1, 0)), s_pe, use_acc=False,
                                 is_async=True)  # fmt: skip
            s_lat = warpgroup_mma(q_lat, kbf.index(s).permute((1, 0)), s_lat, use_acc=False,
                                  is_async=True)  # fmt: skip
            s_pe, s_lat, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_pe, s_lat, acc))
            gl.thread_barrier()  # both warpgroups' P V have read slot j
            mbarrier.arrive(empty.index(j % STAGES), count=1)
        _finish(acc, m_i, l_part, qk_scale, out_ptr, lse_ptr, b, pid_s, row0, num_heads, num_rows,
                stride_ob, stride_os, stride_oq, stride_oh,
                stride_lb, stride_ls, stride_lq, stride_lh, mma_s, mma_o)  # fmt: skip

    @gluon.jit
    def split_kernel_fp8(
        q_lat_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, pt_ptr, sl_ptr, out_ptr, lse_ptr,
        num_heads, num_rows, num_splits, split_tokens, qk_scale, rows_per_page, stride_ptb,
        stride_ob, stride_os, stride_oq, stride_oh,
        stride_lb, stride_ls, stride_lq, stride_lh,
        NUM_Q: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        PE_COL: gl.constexpr, SC_COL: gl.constexpr, NEW_REINTERPRET: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_lat_desc.block_type.shape[0]
        D_LATENT: gl.constexpr = q_lat_desc.block_type.shape[1]
        D_ROPE: gl.constexpr = q_pe_desc.block_type.shape[1]
        SC_W: gl.constexpr = sc_desc.block_type.shape[1]
        pid_s, b, seq_len, start, end, n_tiles = _chunk(sl_ptr, num_splits, split_tokens, BLOCK_N)
        row0 = gl.program_id(0) * BLOCK_M
        q_row0 = (b * num_rows + row0).to(gl.int32)

        dtype: gl.constexpr = q_lat_desc.dtype
        q_lat = gl.allocate_shared_memory(dtype, [BLOCK_M, D_LATENT], q_lat_desc.layout)
        q_pe = gl.allocate_shared_memory(dtype, [BLOCK_M, D_ROPE], q_pe_desc.layout)
        k_pe = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], pe_desc.layout)
        k_sc = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, SC_W], sc_desc.layout)
        kbf_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LATENT], dtype)
        # slot s: bf16 tile s, whose upper half (fp8 tile 2 s + 1) the fp8 tile lands in
        k8 = gl.allocate_shared_memory(
            lat_desc.dtype, [2 * STAGES, BLOCK_N, D_LATENT], lat_desc.layout
        )
        if NEW_REINTERPRET:
            kbf = k8.reinterpret(dtype, [STAGES, BLOCK_N, D_LATENT], kbf_layout)
        else:
            kbf = k8._reinterpret(dtype, [STAGES, BLOCK_N, D_LATENT], kbf_layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
        q_bar, ready, empty = _barriers(STAGES)

        pt_row = pt_ptr + b * stride_ptb
        gl.warp_specialize(
            [
                (_consumer_fp8,
                 (q_lat, q_pe, k8, k_pe, k_sc, kbf, p_smem, q_bar, ready, empty, out_ptr, lse_ptr,
                  b, pid_s, row0, num_heads, num_rows, seq_len, start, end, n_tiles, qk_scale,
                  stride_ob, stride_os, stride_oq, stride_oh,
                  stride_lb, stride_ls, stride_lq, stride_lh, NUM_Q)),
                (_producer,
                 (q_lat_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, q_lat, q_pe, k8, k_pe, k_sc,
                  q_bar, ready, empty, pt_row, q_row0, start, n_tiles, rows_per_page, PAGE_SIZE,
                  PE_COL, SC_COL, 1)),
            ],
            [1],
            [40],
        )  # fmt: skip
