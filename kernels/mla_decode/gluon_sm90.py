"""MLA decode's split kernel for Hopper (sm_90) in Gluon: the heads_major case (64 query rows a
CTA: 128 heads, MTP) on a bf16/fp16 cache, and on an fp8 one (`kv_row_fp8` rows) under a bf16 q.
Same grid, chunking and outputs as the Triton `split_heads_major_kernel`; the launcher's combine
step follows it unchanged.

Why a second kernel: in Triton, the Q K^T dot feeds the P V dot, and Triton then gives it all the
CTA's warps on M (`[8, 1]`): with 64 rows both warpgroups compute the same scores, 13.6 MFLOP of
tensor work a tile where 8.9 are needed (as the compiled kernel's SASS shows). Here the
layouts are explicit: both products use `warps_per_cta = [4, 2]`, so each warpgroup computes half
of the tile's score columns and half of the output's latent columns.

The CTA is warp-specialized: one producer warp loads Q once and each tile's cache rows (latent and
rope, through TMA; the page table gives the tile's page) into a ring of STAGES slots; the eight
consumer warps, per tile: S = Q K^T (two wgmmas: rope, then latent), the online softmax (the row
max is a cross-warpgroup reduction; the row sums are kept per column and summed once at the end),
P through shared memory (each warpgroup needs all of P's columns), then O += P V, left in flight
while the next tile's scores start. A tile is never cut across pages (page_size % BLOCK_N == 0).
The chunk's last, partial tile still comes through TMA whole; its rows past the chunk's end are
zeroed in shared memory before P V (stale cache rows may hold NaN) and masked out of S.

On an fp8 cache (under a bf16 q) the split step runs the kernel of `gluon_fp8_sm90.py`, built
from this file's producer, softmax step and epilogue; `usable` and `launch` serve both.
"""

from __future__ import annotations

import torch

from .. import kv_row_fp8
from ..gluon_sm90_common import GL_DTYPE, IMPORTED, available

if IMPORTED:
    from ..gluon_sm90_common import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

BLOCK_M = 64  # query rows a CTA
SMEM_BYTES = 227 * 1024  # sm_90's shared memory a CTA may take
SCALE_COLS = 4  # fp8 cache: the fp32 columns a tile's scale load takes (TMA's 16-byte minimum)


def usable(q: torch.Tensor, kv_cache: torch.Tensor, lora: int, cfg: dict) -> bool:
    """The config asks for this kernel (`gluon`), the GPU is an sm_90 one, the cache is q's 16-bit
    float type or fp8 rows under a bf16 q, the shapes suit wgmma and TMA, and the CTA's shared
    memory fits. (That every tile lies in one page, the launcher checks: `tile_rows`.)"""
    if not cfg.get("gluon") or not available(q.device) or cfg["BLOCK_M"] != BLOCK_M:
        return False
    fp8 = kv_cache.dtype == torch.uint8
    if fp8 and q.dtype != torch.bfloat16 or not fp8 and kv_cache.dtype != q.dtype:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    block_n, stages = cfg["BLOCK_N"], cfg.get("gluon_stages", 2)
    rope = q.shape[3] - lora
    if kv_cache.stride(1) * kv_cache.element_size() % 16 or kv_cache.data_ptr() % 16:
        return False
    if not 16 <= lora <= 512 or rope < 16 or fp8 and lora % 128:
        return False
    if q.is_contiguous() and q.data_ptr() % 16:  # (a copy made for TMA is aligned)
        return False
    return block_n in (32, 64) and smem_bytes(lora, rope, block_n, stages, fp8) <= SMEM_BYTES


def smem_bytes(lora: int, rope: int, block_n: int, stages: int, fp8: bool) -> int:
    """The split kernel's shared memory: Q, the ring of cache tiles (on an fp8 cache, each slot
    holds its latent in bf16, converted in place, and its scale columns), P, and 1 KB for
    barriers and scratch."""
    tile = 2 * block_n * (lora + rope) + (4 * SCALE_COLS * block_n if fp8 else 0)
    return 2 * BLOCK_M * (lora + rope) + stages * tile + 2 * BLOCK_M * block_n + 1024


if IMPORTED:

    @gluon.jit
    def _producer(q_lat_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, q_lat, q_pe, k_lat, k_pe, k_sc,
                  q_bar, ready, empty, pt_row, q_row0, start, n_tiles, rows_per_page,
                  PAGE_SIZE: gl.constexpr, PE_COL: gl.constexpr, SC_COL: gl.constexpr,
                  LAT_HALF: gl.constexpr):  # fmt: skip
        """One warp: Q's rows once, then each tile's cache rows (latent, rope and, for an fp8
        cache (SC_COL > 0), the scale column) into ring slot j % STAGES, once the consumers have
        released the slot's previous tile. PE_COL / SC_COL: the rope part's first column in
        pe_desc's elements, the scale's in sc_desc's. LAT_HALF: slot s's latent goes to
        k_lat.index(2 * s + 1), the upper half of a 16-bit slot (`_expand`), not k_lat.index(s)."""
        STAGES: gl.constexpr = k_pe.shape[0]
        BLOCK_N: gl.constexpr = k_pe.shape[1]
        D_LATENT: gl.constexpr = q_lat.shape[1]
        mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
        tma_load(q_lat_desc, [q_row0, 0], q_bar, q_lat)
        tma_load(q_pe_desc, [q_row0, D_LATENT], q_bar, q_pe)
        for j in range(n_tiles):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # the first round passes
            n0 = start + j * BLOCK_N
            page = gl.load(pt_row + n0 // PAGE_SIZE).to(gl.int32)
            first = page * rows_per_page + n0 % PAGE_SIZE
            bar = ready.index(s)
            if SC_COL > 0:
                mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes
                                + sc_desc.block_type.nbytes)  # fmt: skip
                tma_load(sc_desc, [first, SC_COL], bar, k_sc.index(s))
            else:
                mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
            tma_load(lat_desc, [first, 0], bar, k_lat.index(s * (1 + LAT_HALF) + LAT_HALF))
            tma_load(pe_desc, [first, PE_COL], bar, k_pe.index(s))

    @gluon.jit
    def _zero_rows(buf, valid):
        """Rows >= valid of a [BLOCK_N, D] shared tile set to zero, 64 columns at a time."""
        BLOCK_N: gl.constexpr = buf.shape[0]
        D: gl.constexpr = buf.shape[1]
        CH: gl.constexpr = 64 if D > 64 else D
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(D // CH):
            part = buf.slice(c * CH, CH, dim=1)
            x = part.load(layout)
            part.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _scores(q_lat, q_pe, k_lat, k_pe, ready, s_acc, t, n_tiles, start, end):
        """Issues tile t's S = Q K^T (rope, then latent) into s_acc's registers (use_acc=False),
        after its rows past `end` are zeroed when it is the partial last tile. Past the last tile
        it reads whatever the slot holds and the caller drops the result: nothing waits for a
        load that never comes."""
        STAGES: gl.constexpr = k_lat.shape[0]
        BLOCK_N: gl.constexpr = k_lat.shape[1]
        s = t % STAGES
        live = t < n_tiles
        mbarrier.wait(ready.index(s), (t // STAGES) & 1, pred=live)
        n0 = start + t * BLOCK_N
        if live & (n0 + BLOCK_N > end):  # the partial last tile
            _zero_rows(k_lat.index(s), end - n0)
        s_acc = warpgroup_mma(q_pe, k_pe.index(s).permute((1, 0)), s_acc, use_acc=False,
                              is_async=True)  # fmt: skip
        return warpgroup_mma(q_lat, k_lat.index(s).permute((1, 0)), s_acc, is_async=True)

    @gluon.jit
    def _softmax_tile(s_acc, pos, visible, end, m_i, l_part, acc, qk_scale,
                      mma_o: gl.constexpr):  # fmt: skip
        """One tile of the online softmax: scores s_acc [BLOCK_M, BLOCK_N] (unscaled) at cache
        positions pos, masked to the positions each row sees; returns p, the new running max
        (kept unscaled: qk_scale > 0, so scaling and subtracting it is one FMA), the per-column
        partial sums and acc, both rescaled."""
        seen = (pos[None, :] < visible[:, None]) & (pos < end)[None, :]
        qk = gl.where(seen, s_acc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = gl.exp2(qk * qk_scale - (m_safe * qk_scale)[:, None])
        alpha = gl.exp2((m_i - m_safe) * qk_scale)
        l_part = l_part * alpha[:, None] + p
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
        return p, m_new, l_part, acc

    @gluon.jit
    def _finish(acc, m_i, l_part, qk_scale, out_ptr, lse_ptr, b, pid_s, row0, num_heads,
                num_rows, stride_ob, stride_os, stride_oq, stride_oh,
                stride_lb, stride_ls, stride_lq, stride_lh,
                mma_s: gl.constexpr, mma_o: gl.constexpr):  # fmt: skip
        """out = O / l and the chunk's natural-log lse, stored for the CTA's rows."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        D_LATENT: gl.constexpr = acc.shape[1]
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
        l_i = gl.sum(l_part, 1)
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        lse = gl.where(has, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        rows_o = row0 + gl.arange(0, BLOCK_M, layout=row_o)
        offs_d = gl.arange(0, D_LATENT, layout=gl.SliceLayout(0, mma_o))
        o_row = (
            out_ptr + b * stride_ob + pid_s * stride_os
            + (rows_o // num_heads) * stride_oq + (rows_o % num_heads) * stride_oh
        )  # fmt: skip
        gl.store(o_row[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows_o < num_rows)[:, None])  # fmt: skip
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        lse_row = (
            lse_ptr + b * stride_lb + pid_s * stride_ls
            + (rows // num_heads) * stride_lq + (rows % num_heads) * stride_lh
        )  # fmt: skip
        gl.store(lse_row, lse, mask=rows < num_rows)

    @gluon.jit
    def _consumer(q_lat, q_pe, k_lat, k_pe, p_smem, q_bar, ready, empty, out_ptr, lse_ptr, b,
                  pid_s, row0, num_heads, num_rows, seq_len, start, end, n_tiles, qk_scale,
                  stride_ob, stride_os, stride_oq, stride_oh,
                  stride_lb, stride_ls, stride_lq, stride_lh, NUM_Q: gl.constexpr):  # fmt: skip
        """Eight warps (two warpgroups, each half of S's columns and of O's): the online softmax
        over the chunk's tiles, then out = O / l and the chunk's natural-log lse."""
        STAGES: gl.constexpr = k_lat.shape[0]
        BLOCK_N: gl.constexpr = k_lat.shape[1]
        D_LATENT: gl.constexpr = k_lat.shape[2]
        BLOCK_M: gl.constexpr = q_lat.shape[0]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_LATENT // 2, 16]
        )
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        visible = seq_len - NUM_Q + 1 + rows // num_heads  # positions < visible are seen
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_part = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        acc = gl.zeros([BLOCK_M, D_LATENT], gl.float32, mma_o)
        mbarrier.wait(q_bar, 0)
        s_acc = _scores(q_lat, q_pe, k_lat, k_pe, ready, s_acc, 0, n_tiles, start, end)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
        for j in range(n_tiles):
            pos = start + j * BLOCK_N + offs_n
            p, m_i, l_part, acc = _softmax_tile(s_acc, pos, visible, end, m_i, l_part, acc,
                                                qk_scale, mma_o)  # fmt: skip
            # both warpgroups have waited for the previous tile's P V: its slot and P are free
            gl.thread_barrier()
            mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
            p_smem.store(p.to(p_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(p_smem, k_lat.index(j % STAGES), acc, is_async=True)
            # the next tile's scores queue behind P V; nothing is in flight across the loop's
            # back-edge (ptxas would serialize every wgmma, its note C7515)
            s_acc = _scores(q_lat, q_pe, k_lat, k_pe, ready, s_acc, j + 1, n_tiles, start, end)
            s_acc, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, acc))
        _finish(acc, m_i, l_part, qk_scale, out_ptr, lse_ptr, b, pid_s, row0, num_heads, num_rows,
                stride_ob, stride_os, stride_oq, stride_oh,
                stride_lb, stride_ls, stride_lq, stride_lh, mma_s, mma_o)  # fmt: skip

    @gluon.jit
    def _barriers(STAGES: gl.constexpr):
        """Q's barrier, and each ring slot's ready and empty barriers, initialized."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)
            mbarrier.init(empty.index(slot), count=1)
        return q_bar, ready, empty

    @gluon.jit
    def _chunk(sl_ptr, num_splits, split_tokens, BLOCK_N: gl.constexpr):
        """This CTA's split and request, the request's length, and its chunk [start, end) of cache
        positions in n_tiles tiles: the cache cut into num_splits chunks of whole tiles, or into
        chunks of split_tokens when that is > 0 (batch-invariant mode)."""
        pid_s = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        seq_len = gl.load(sl_ptr + b).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        if split_tokens > 0:
            chunk = split_tokens
        start = pid_s * chunk
        end = gl.minimum(start + chunk, seq_len)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        return pid_s, b, seq_len, start, end, n_tiles

    @gluon.jit
    def _split_kernel(
        q_lat_desc, q_pe_desc, lat_desc, pe_desc, pt_ptr, sl_ptr, out_ptr, lse_ptr,
        num_heads, num_rows, num_splits, split_tokens, qk_scale, rows_per_page, stride_ptb,
        stride_ob, stride_os, stride_oq, stride_oh,
        stride_lb, stride_ls, stride_lq, stride_lh,
        NUM_Q: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_lat_desc.block_type.shape[0]
        D_LATENT: gl.constexpr = q_lat_desc.block_type.shape[1]
        D_ROPE: gl.constexpr = q_pe_desc.block_type.shape[1]
        pid_s, b, seq_len, start, end, n_tiles = _chunk(sl_ptr, num_splits, split_tokens, BLOCK_N)
        row0 = gl.program_id(0) * BLOCK_M
        q_row0 = (b * num_rows + row0).to(gl.int32)

        dtype: gl.constexpr = q_lat_desc.dtype
        q_lat = gl.allocate_shared_memory(dtype, [BLOCK_M, D_LATENT], q_lat_desc.layout)
        q_pe = gl.allocate_shared_memory(dtype, [BLOCK_M, D_ROPE], q_pe_desc.layout)
        k_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_LATENT], lat_desc.layout)
        k_pe = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], pe_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
        q_bar, ready, empty = _barriers(STAGES)

        pt_row = pt_ptr + b * stride_ptb
        gl.warp_specialize(
            [
                (_consumer,
                 (q_lat, q_pe, k_lat, k_pe, p_smem, q_bar, ready, empty, out_ptr, lse_ptr, b, pid_s,
                  row0, num_heads, num_rows, seq_len, start, end, n_tiles, qk_scale,
                  stride_ob, stride_os, stride_oq, stride_oh,
                  stride_lb, stride_ls, stride_lq, stride_lh, NUM_Q)),
                (_producer,
                 (q_lat_desc, q_pe_desc, lat_desc, pe_desc, pe_desc, q_lat, q_pe, k_lat, k_pe, k_pe,
                  q_bar, ready, empty, pt_row, q_row0, start, n_tiles, rows_per_page, PAGE_SIZE,
                  D_LATENT, 0, 0)),
            ],
            [1],
            [40],
        )  # fmt: skip


def launch(q, kv_cache, cache_rows, page_table, seq_lens, part, part_lse, o_strides, l_strides,
           num_splits, split_tokens, qk_scale, lora, cfg) -> None:  # fmt: skip
    """The split step of `mla_decode_launch` on this kernel (`usable` must hold; cache_rows: the
    launcher's `tile_rows`): writes part / part_lse (strides o_strides / l_strides, split stride
    0 when unsplit) like the Triton one. An fp8 cache (`kv_row_fp8` rows) is read through three
    descriptors over the same bytes: its latent as e4m3, its rope as bf16, its scale as fp32."""
    batch, num_q, num_heads, width = q.shape
    num_rows = num_q * num_heads
    rope = width - lora
    block_n = cfg["BLOCK_N"]
    page_size = kv_cache.shape[1]
    rows_per_page = kv_cache.stride(0) // kv_cache.stride(1)
    dtype = GL_DTYPE[q.dtype]
    q2 = q.reshape(batch * num_rows, width)
    lay = gl.NVMMASharedLayout.get_default_for
    q_lat_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, lora], lay([BLOCK_M, lora], dtype))
    q_pe_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, rope], lay([BLOCK_M, rope], dtype))

    def desc(view: torch.Tensor, box: list[int], gl_dtype) -> TensorDescriptor:
        """A descriptor over the cache's rows (`cache_rows` of them) seen as `view`'s dtype."""
        shape, strides = [cache_rows, view.shape[2]], [view.stride(1), 1]
        return TensorDescriptor(view, shape, strides, box, lay(box, gl_dtype))

    grid = (-(-num_rows // BLOCK_M), num_splits, batch)
    args = (page_table, seq_lens, part, part_lse, num_heads, num_rows, num_splits, split_tokens,
            qk_scale, rows_per_page, page_table.stride(0), *o_strides, *l_strides)  # fmt: skip
    stages = cfg.get("gluon_stages", 2)
    if kv_cache.dtype == torch.uint8:
        lat_desc = desc(kv_cache.view(torch.float8_e4m3fn), [block_n, lora], gl.float8e4nv)
        pe_desc = desc(kv_cache.view(torch.bfloat16), [block_n, rope], gl.bfloat16)
        sc_desc = desc(kv_cache.view(torch.float32), [block_n, SCALE_COLS], gl.float32)
        from .gluon_fp8_sm90 import split_kernel_fp8  # (that module imports this one's pieces)

        split_kernel_fp8[grid](
            q_lat_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, *args,
            NUM_Q=num_q, PAGE_SIZE=page_size, BLOCK_N=block_n, STAGES=stages,
            PE_COL=kv_row_fp8.rope_offset(lora) // 2,
            SC_COL=kv_row_fp8.scale_offset(lora, rope) // 4,
            NEW_REINTERPRET=hasattr(gl.shared_memory_descriptor, "reinterpret"), num_warps=8,
        )  # fmt: skip
        return
    lat_desc = desc(kv_cache, [block_n, lora], dtype)
    pe_desc = desc(kv_cache, [block_n, rope], dtype)
    _split_kernel[grid](
        q_lat_desc, q_pe_desc, lat_desc, pe_desc, *args,
        NUM_Q=num_q, PAGE_SIZE=page_size, BLOCK_N=block_n, STAGES=stages, num_warps=8,
    )  # fmt: skip
