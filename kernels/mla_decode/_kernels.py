"""The Triton kernels of MLA decode and of the fp8 cache writer; `triton.py` launches them.

Split kernels: program (m-block, split, request) attends BLOCK_M of the request's Q * H query rows
(row = query * H + head) to one chunk [start, end) of its cache positions with an online softmax,
BLOCK_N positions per tile. A tile's keys are whole cache rows and its values the latent part of the
same rows, loaded once. The full tiles of a chunk run unmasked (through TMA descriptors when
USE_TMA: one page holds a whole tile); the chunk's last, partial tile runs in a second loop (of
at most one trip) with masked loads, so no position past `end` is ever read. The tail is a loop,
not an `if`, so that Triton's pipeliner stages its loads through asynchronous copies too: with
Triton 3.6 on sm_90, a bf16 tile loaded into registers and stored to shared memory for the
kv_major layout's transposed P @ V operand gave wrong results (see the launcher's stage floor).
Outputs are normalised with the chunk's natural-log lse; a chunk a row sees nothing of gives out 0
and lse -inf.

Cache strides are in bytes for an fp8 cache (kv_ptr: uint8; kv16_ptr / kv32_ptr: the same memory
viewed as bf16 / fp32), in elements otherwise. qk_scale = softmax_scale * log2(e).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kv_row_triton import quantize_row_fp8, slot_row

E4M3_TO_BF16_PTX = tl.constexpr("""{
    .reg .b32 t0, t1, k;
    prmt.b32 t0, $2, 0, 0x1404;
    prmt.b32 t1, $2, 0, 0x3424;
    shr.b32 $0, t0, 4;
    shr.b32 $1, t1, 4;
    and.b32 $0, $0, 0x07F007F0;
    and.b32 $1, $1, 0x07F007F0;
    and.b32 t0, t0, 0x80008000;
    and.b32 t1, t1, 0x80008000;
    or.b32 $0, $0, t0;
    or.b32 $1, $1, t1;
    mov.b32 k, 0x7B807B80;
    mul.rn.bf16x2 $0, $0, k;
    mul.rn.bf16x2 $1, $1, k;
    }""")
"""Four e4m3 bytes ($2) to four bf16 values ($0, $1), exactly, in integer ops: each byte's sign,
exponent and mantissa bits moved to their bf16 places give the value times 2^-120 (subnormals
included, since both formats then read the bits the same way), and one packed bf16 multiply by
2^120 restores it. NaN bytes do not come out NaN (the cache format never holds them). For
`inline_asm_elementwise(..., "=r,=r,r", pack=4)`, in the Triton and the Gluon kernels."""
FP8_CVT, FP8_ASM = tl.constexpr(1), tl.constexpr(2)
"""KV_FP8 values of the split kernels: a float cache is 0; an fp8 cache converted by Triton's casts
(any q dtype, and the interpreter), or by E4M3_TO_BF16_PTX (a bf16 q on a GPU)."""

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _split_prologue(sl_ptr, num_heads, num_rows, num_splits, split_tokens, NUM_Q, BLOCK_M, BLOCK_N):
    """This program's request, split, query rows and chunk [start, end) of cache positions: the
    request's cache cut into `num_splits` chunks, or into chunks of `split_tokens` when that is
    > 0 (batch-invariant mode: the cut then depends on the request alone)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(sl_ptr + b).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < num_rows
    qi = rows // num_heads
    h = rows % num_heads
    visible = seq_len - NUM_Q + 1 + qi  # [BLOCK_M]: positions < visible are seen
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    if split_tokens > 0:
        chunk = split_tokens
    start = pid_s * chunk
    end = tl.minimum(start + chunk, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    return b, pid_s, row_ok, qi, h, visible, start, end, full_end


@triton.jit
def _fp8_latent(c8, DTYPE: tl.constexpr, KV_FP8: tl.constexpr):
    """An fp8 tile's latent bytes (uint8) as DTYPE values, unscaled."""
    if KV_FP8 == FP8_ASM:
        return tl.inline_asm_elementwise(
            E4M3_TO_BF16_PTX, "=r,=r,r", [c8], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    else:
        return c8.to(tl.float8e4nv, bitcast=True).to(DTYPE)


@triton.jit
def _load_kv_tile(
    kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_row, n0, end, stride_kvp, stride_kvr,
    PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """Cache positions n0 .. n0 + BLOCK_N of a request: latent [BLOCK_N, D_LATENT] and rope
    [BLOCK_N, D_ROPE] in DTYPE, and the fp8 scales [BLOCK_N] (ones for a float cache). MASKED: rows
    at or past `end` read as zeros and are never touched. USE_TMA (unmasked tiles only): the tile
    lies in one page and comes through the descriptors."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    if USE_TMA and not MASKED:
        page = tl.load(pt_row + n0 // PAGE_SIZE).to(tl.int32)
        # the tile's first row in the descriptors' rows (pages are stride_kvp // stride_kvr rows apart)
        first = page * (stride_kvp // stride_kvr) + n0 % PAGE_SIZE
        if KV_FP8:
            kv = _fp8_latent(kv_desc.load([first, 0]), DTYPE, KV_FP8)
            kpe = pe_desc.load([first, D_LATENT // 2]).to(DTYPE)
        else:
            kv = kv_desc.load([first, 0])
            kpe = pe_desc.load([first, D_LATENT])
        row_off = (
            page.to(tl.int64) * stride_kvp + (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)) * stride_kvr
        )
    else:
        n_ok = offs_n < end
        if MASKED:
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE).to(tl.int64)
        row_off = page * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvr  # [BLOCK_N]
        if KV_FP8:
            row_off = tl.multiple_of(row_off, 16)
            c8_ptrs = kv_ptr + row_off[:, None] + offs_l[None, :]
            off16 = tl.multiple_of((row_off + D_LATENT) // 2, 8)
            pe_ptrs = kv16_ptr + off16[:, None] + offs_r[None, :]
            if MASKED:
                c8 = tl.load(c8_ptrs, mask=n_ok[:, None], other=0)
                kpe = tl.load(pe_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                c8 = tl.load(c8_ptrs)
                kpe = tl.load(pe_ptrs)
            kv = _fp8_latent(c8, DTYPE, KV_FP8)
            kpe = kpe.to(DTYPE)
        else:
            kv_ptrs = kv_ptr + row_off[:, None] + offs_l[None, :]
            pe_ptrs = kv_ptr + row_off[:, None] + D_LATENT + offs_r[None, :]
            if MASKED:
                kv = tl.load(kv_ptrs, mask=n_ok[:, None], other=0.0)
                kpe = tl.load(pe_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                kv = tl.load(kv_ptrs)
                kpe = tl.load(pe_ptrs)
    if KV_FP8:
        scale_ptrs = kv32_ptr + (row_off + D_LATENT + 2 * D_ROPE) // 4
        if MASKED:
            scale = tl.load(scale_ptrs, mask=offs_n < end, other=0.0)
        else:
            scale = tl.load(scale_ptrs)
    else:
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return kv, kpe, scale, offs_n


@triton.jit
def _attend_heads_major(
    q_lat, q_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_i, acc, qk_scale,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, ALL_SEEN: tl.constexpr,
):  # fmt: skip
    """One tile of online softmax with query rows as M: S = Q K^T [M, N], O += P V [M, D_LATENT].
    ALL_SEEN: every row sees every position of the tile (see _attend_kv_major), so no mask."""
    if KV_FP8:
        qk = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION) * scale[None, :]
        qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision=DOT_PRECISION)
    else:
        qk = tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION)
        qk = tl.dot(q_lat, tl.trans(kv), qk, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    # the running max m_i is kept in unscaled units (qk_scale > 0): scaling and subtracting it
    # is then one FMA per score
    s = qk
    if not ALL_SEEN:
        seen = (offs_n[None, :] < visible[:, None]) & (offs_n < end)[None, :]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if not ALL_SEEN:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    alpha = tl.exp2((m_i - m_safe) * qk_scale)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if KV_FP8:
        p = p * scale[None, :]  # values are c8 * scale: fold the scale into p
    acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_kv_major(
    qt_lat, qt_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_part, acc, qk_scale,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, ALL_SEEN: tl.constexpr,
):  # fmt: skip
    """One tile with cache positions as M: S^T = K Q^T [N, M], O^T += V^T P^T [D_LATENT, M].
    l_part [N, M] holds per-position partial sums of P (rescaled with the running max), summed over
    positions once after the last tile: a cross-warp reduction fewer per tile. ALL_SEEN: every
    row sees every position of the tile (a full tile, one query per request), so no mask."""
    if KV_FP8:
        st = tl.dot(kv, qt_lat, input_precision=DOT_PRECISION) * scale[:, None]
        st = tl.dot(kpe, qt_pe, st, input_precision=DOT_PRECISION)
    else:
        st = tl.dot(kpe, qt_pe, input_precision=DOT_PRECISION)
        st = tl.dot(kv, qt_lat, st, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    s = st * qk_scale
    if not ALL_SEEN:
        seen = (offs_n[:, None] < visible[None, :]) & (offs_n < end)[:, None]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = m_new
    if not ALL_SEEN:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_part = l_part * alpha[None, :] + p
    if KV_FP8:
        p = p * scale[:, None]
    acc = acc * alpha[None, :]
    acc = tl.dot(tl.trans(kv), p.to(kv.dtype), acc, input_precision=DOT_PRECISION)
    return m_new, l_part, acc


@triton.jit
def split_heads_major_kernel(
    q_ptr, kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_ptr, sl_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, num_splits, split_tokens, qk_scale,
    stride_qb, stride_qq, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ob, stride_os, stride_oq, stride_oh,
    stride_lb, stride_ls, stride_lq, stride_lh,
    NUM_Q: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """Split kernel with the query rows as the matrix M dimension (many rows: 128 heads, MTP)."""
    b, pid_s, row_ok, qi, h, visible, start, end, full_end = _split_prologue(
        sl_ptr, num_heads, num_rows, num_splits, split_tokens, NUM_Q, BLOCK_M, BLOCK_N
    )
    if (split_tokens > 0) & (start >= end):
        return  # past the request's cache in fixed-size chunks: the combine does not read it
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + b * stride_qb + qi * stride_qq + h * stride_qh  # [BLOCK_M]
    q_lat = tl.load(q_row[:, None] + offs_l[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row[:, None] + D_LATENT + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
    pt_row = pt_ptr + b * stride_ptb
    for n0 in range(start, full_end, BLOCK_N):
        kv, kpe, scale, offs_n = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, q_lat.dtype, False, USE_TMA,
        )  # fmt: skip
        m_i, l_i, acc = _attend_heads_major(
            q_lat, q_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_i, acc, qk_scale,
            KV_FP8, DOT_PRECISION, NUM_Q == 1,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):  # the partial last tile, if any: a loop of 0 or 1
        kv, kpe, scale, offs_n = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, q_lat.dtype, True, USE_TMA,
        )  # fmt: skip
        m_i, l_i, acc = _attend_heads_major(
            q_lat, q_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_i, acc, qk_scale,
            KV_FP8, DOT_PRECISION, False,
        )  # fmt: skip

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i * qk_scale + tl.log2(l_safe)) * LN2, float("-inf"))
    o_row = out_ptr + b * stride_ob + pid_s * stride_os + qi * stride_oq + h * stride_oh
    o_ptrs = o_row[:, None] + offs_l[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse_row = lse_ptr + b * stride_lb + pid_s * stride_ls + qi * stride_lq + h * stride_lh
    tl.store(lse_row, lse, mask=row_ok)


@triton.jit
def split_kv_major_kernel(
    q_ptr, kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_ptr, sl_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, num_splits, split_tokens, qk_scale,
    stride_qb, stride_qq, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ob, stride_os, stride_oq, stride_oh,
    stride_lb, stride_ls, stride_lq, stride_lh,
    NUM_Q: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """Split kernel with cache positions as the matrix M dimension: with few query rows (16 heads)
    the tensor-core tiles stay full (M = BLOCK_N positions, not 16 rows) and every operand stays in
    shared memory, so nothing large but the accumulator is held in registers."""
    b, pid_s, row_ok, qi, h, visible, start, end, full_end = _split_prologue(
        sl_ptr, num_heads, num_rows, num_splits, split_tokens, NUM_Q, BLOCK_M, BLOCK_N
    )
    if (split_tokens > 0) & (start >= end):
        return  # past the request's cache in fixed-size chunks: the combine does not read it
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + b * stride_qb + qi * stride_qq + h * stride_qh  # [BLOCK_M]
    qt_lat = tl.load(q_row[None, :] + offs_l[:, None], mask=row_ok[None, :], other=0.0)  # [DL, M]
    qt_pe = tl.load(q_row[None, :] + D_LATENT + offs_r[:, None], mask=row_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = tl.zeros([D_LATENT, BLOCK_M], tl.float32)
    pt_row = pt_ptr + b * stride_ptb
    for n0 in range(start, full_end, BLOCK_N):
        kv, kpe, scale, offs_n = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, qt_lat.dtype, False, USE_TMA,
        )  # fmt: skip
        m_i, l_part, acc = _attend_kv_major(
            qt_lat, qt_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_part, acc, qk_scale,
            KV_FP8, DOT_PRECISION, NUM_Q == 1,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):  # the partial last tile, if any: a loop of 0 or 1
        kv, kpe, scale, offs_n = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, kv_desc, pe_desc, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, qt_lat.dtype, True, USE_TMA,
        )  # fmt: skip
        m_i, l_part, acc = _attend_kv_major(
            qt_lat, qt_pe, kv, kpe, scale, offs_n, end, visible, m_i, l_part, acc, qk_scale,
            KV_FP8, DOT_PRECISION, False,
        )  # fmt: skip

    l_i = tl.sum(l_part, 0)
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[None, :]  # [D_LATENT, BLOCK_M]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_row = out_ptr + b * stride_ob + pid_s * stride_os + qi * stride_oq + h * stride_oh
    o_ptrs = o_row[None, :] + offs_l[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
    lse_row = lse_ptr + b * stride_lb + pid_s * stride_ls + qi * stride_lq + h * stride_lh
    tl.store(lse_row, lse, mask=row_ok)


@triton.jit
def _store_combined(
    out_ptr, lse_ptr, acc, denom, m_safe, row, b, offs_d, num_heads,
    stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
):  # fmt: skip
    """A combine's epilogue: out = acc / denom (0 where no split saw anything), and the row's lse
    from the first d-block's program."""
    has = denom > 0.0
    d_safe = tl.where(has, denom, 1.0)
    qi = row // num_heads
    h = row % num_heads
    o_row = out_ptr + b * stride_ob + qi * stride_oq + h * stride_oh
    tl.store(o_row + offs_d, (acc / d_safe).to(out_ptr.dtype.element_ty))
    if tl.program_id(2) == 0:
        lse = tl.where(has, m_safe + tl.log(d_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + qi * stride_lq + h * stride_lh, lse)


@triton.jit
def combine_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, num_splits,
    stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
    D_LATENT: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):  # fmt: skip
    """Merges the splits of one query row over BLOCK_D latent dims: program (row, request, d-block).
    part: [B, num_splits, rows, D_LATENT] fp32; part_lse: [B, num_splits, rows] fp32. The splits are
    read SPLIT_CHUNK at a time, so a request cut into many splits (small batch, long cache) is not
    a long serial loop."""
    row = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_base = part_lse_ptr + b * num_splits * num_rows + row
    splits = tl.arange(0, SPLITS_P2)
    lse_all = tl.load(lse_base + splits * num_rows, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp(lse_all - m_safe), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    part_base = part_ptr + (b * num_splits * num_rows + row) * D_LATENT
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        chunk = s0 + tl.arange(0, SPLIT_CHUNK)
        ok = chunk < num_splits
        w = tl.exp(tl.load(lse_base + chunk * num_rows, mask=ok, other=float("-inf")) - m_safe)
        o_ptrs = part_base + chunk[:, None] * num_rows * D_LATENT + offs_d[None, :]
        o = tl.load(o_ptrs, mask=ok[:, None], other=0.0)  # [SPLIT_CHUNK, BLOCK_D]
        acc += tl.sum(w[:, None] * o, 0)
    _store_combined(
        out_ptr, lse_ptr, acc, denom, m_safe, row, b, offs_d, num_heads,
        stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
    )  # fmt: skip


@triton.jit
def combine_invariant_kernel(
    part_ptr, part_lse_ptr, sl_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, num_splits, split_tokens,
    stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
    D_LATENT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The combine of batch-invariant mode: merges the request's own splits (ceil(seq_len /
    split_tokens) of them) one at a time in split order, so the sums never depend on the grid's
    split count (the batch's longest request)."""
    row = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    own = tl.cdiv(tl.load(sl_ptr + b).to(tl.int32), split_tokens)
    lse_base = part_lse_ptr + b * num_splits * num_rows + row
    part_base = part_ptr + (b * num_splits * num_rows + row) * D_LATENT
    m = float("-inf")
    for s in range(own):
        m = tl.maximum(m, tl.load(lse_base + s * num_rows))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(own):
        w = tl.exp(tl.load(lse_base + s * num_rows) - m_safe)
        denom += w
        acc += w * tl.load(part_base + s * num_rows * D_LATENT + offs_d)
    _store_combined(
        out_ptr, lse_ptr, acc, denom, m_safe, row, b, offs_d, num_heads,
        stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
    )  # fmt: skip


@triton.jit
def write_kv_fp8_kernel(
    c_ptr, kpe_ptr, slot_ptr, cache8_ptr, cache16_ptr, cache32_ptr,
    stride_c, stride_k, stride_page, stride_row,
    PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """Quantizes one token's row into the fp8 format at its slot. Cache strides are in bytes."""
    t = tl.program_id(0).to(tl.int64)
    row_off = tl.multiple_of(slot_row(slot_ptr, t, stride_page, stride_row, PAGE_SIZE), 16)
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    c8, scale = quantize_row_fp8(tl.load(c_ptr + t * stride_c + offs_l), FP8_MAX)
    tl.store(cache8_ptr + row_off + offs_l, c8)
    kpe = tl.load(kpe_ptr + t * stride_k + offs_r).to(tl.bfloat16)
    off16 = tl.multiple_of((row_off + D_LATENT) // 2, 8)
    tl.store(cache16_ptr + off16 + offs_r, kpe)
    tl.store(cache32_ptr + (row_off + D_LATENT + 2 * D_ROPE) // 4, scale)


@triton.jit
def write_kv_kernel(
    c_ptr, kpe_ptr, slot_ptr, cache_ptr, num_tokens,
    stride_c, stride_k, stride_page, stride_row,
    PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Stores ROWS tokens' [c_kv | k_pe], cast to the cache's dtype, at their slots of a float cache."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    for i in tl.static_range(ROWS):
        t = tl.program_id(0).to(tl.int64) * ROWS + i
        if t < num_tokens:
            row = cache_ptr + slot_row(slot_ptr, t, stride_page, stride_row, PAGE_SIZE)
            c = tl.load(c_ptr + t * stride_c + offs_l, mask=offs_l < D_LATENT)
            tl.store(row + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < D_LATENT)
            k = tl.load(kpe_ptr + t * stride_k + offs_r, mask=offs_r < D_ROPE)
            tl.store(
                row + D_LATENT + offs_r, k.to(cache_ptr.dtype.element_ty), mask=offs_r < D_ROPE
            )
