"""MLA decode attention (absorbed, paged latent cache, split-KV) and the fp8 cache writer in Triton.

Same contracts as `ref.py`. `mla_decode` runs in one or two launches:

1. the split kernel: program (m-block, split, request) takes BLOCK_M of the request's Q * H query
   rows (row = query * H + head) and one contiguous chunk of its cache positions, streams that chunk
   through the page table BLOCK_N positions at a time (keys = whole rows, values = the latent part
   of the same tile, read once) and keeps an online softmax. Each row masks the positions its query
   may not see (MTP: causal among the Q queries). Two layouts of the same math: `heads_major` (query
   rows are the MMA's M) and `kv_major` (cache positions are the MMA's M; fills the tensor cores
   when a request has few query rows, e.g. 16 heads).
2. with more than one split, the combine kernel merges the splits' normalised outputs through
their
   log-sum-exps.

The split count is picked on the host, with no device sync, from the batch, the m-blocks, the
longest possible sequence (page_table columns * page_size) and the number of SMs, to fill the GPU
in few, full waves; each request then cuts its own length into that many chunks (so short
requests get short chunks). Launch configs (BLOCK_N, warps, stages, split policy) come from
`tuning` under the key "<cache dtype>,m<BLOCK_M>".

The m-block is the fastest grid axis, so the programs that read the same chunk for different
heads run together and the second read of a chunk comes from L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import tuning
from . import fp8_format

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)
_CACHE_NAMES = {
    torch.uint8: "fp8",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}
_INTERPRETER_SMS = 4
"""SM count the split policy assumes without a GPU (the interpreter), so tests exercise splits."""

_SPLIT_POLICY = {"CTAS_PER_SM": 1, "MAX_SPLITS": 64, "MIN_TILES_PER_SPLIT": 2}
# Key: "<cache dtype>,m<16|32|64>" by the request's query rows Q * H (m64: 64 or more). LAYOUT picks
# the split kernel; BLOCK_M is the query rows per program, BLOCK_N the cache positions per tile.
_BF16_M16 = {"LAYOUT": "kv_major", "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
_BF16_M32 = {"LAYOUT": "kv_major", "BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
_BF16_M64 = {"LAYOUT": "heads_major", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
tuning.register(
    "mla_decode",
    "any",
    {"default": {"LAYOUT": "heads_major", "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4,
                 "num_stages": 1, **_SPLIT_POLICY}},
)  # fmt: skip
tuning.register(
    "mla_decode",
    "sm90",
    {
        "default": {**_BF16_M16, **_SPLIT_POLICY},
        "bf16,m16": {**_BF16_M16, **_SPLIT_POLICY},
        "bf16,m32": {**_BF16_M32, **_SPLIT_POLICY},
        "bf16,m64": {**_BF16_M64, **_SPLIT_POLICY},
        "fp8,m16": {**_BF16_M16, **_SPLIT_POLICY},
        "fp8,m32": {**_BF16_M32, **_SPLIT_POLICY},
        "fp8,m64": {**_BF16_M64, **_SPLIT_POLICY},
    },
)


@triton.jit
def _split_prologue(sl_ptr, num_heads, num_rows, NUM_Q, NUM_SPLITS, BLOCK_M, BLOCK_N):
    """This program's request b, query rows (row = query * H + head) and chunk [start, end) of
    positions."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(sl_ptr + b).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < num_rows
    qi = rows // num_heads
    h = rows % num_heads
    visible = seq_len - NUM_Q + 1 + qi  # [BLOCK_M]: positions < visible are seen
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, seq_len)
    return b, pid_s, row_ok, qi, h, visible, start, end


@triton.jit
def _load_kv_tile(
    kv_ptr, kv16_ptr, kv32_ptr, pt_row, n0, end, stride_kvp, stride_kvr,
    PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Cache rows n0 .. n0 + BLOCK_N of a request (zeros past `end`): latent [BLOCK_N, D_LATENT] and
    rope [BLOCK_N, D_ROPE] in DTYPE, the fp8 scales [BLOCK_N] (ones for a float cache), positions,
    validity."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    row_off = page * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvr  # [BLOCK_N]
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    if KV_FP8:
        row_off = tl.multiple_of(row_off, 16)
        c8 = tl.load(kv_ptr + row_off[:, None] + offs_l[None, :], mask=n_ok[:, None], other=0)
        kv = c8.to(tl.float8e4nv, bitcast=True).to(DTYPE)
        off16 = tl.multiple_of((row_off + D_LATENT) // 2, 8)
        kpe = tl.load(kv16_ptr + off16[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0)
        kpe = kpe.to(DTYPE)
        scale = tl.load(kv32_ptr + (row_off + D_LATENT + 2 * D_ROPE) // 4, mask=n_ok, other=0.0)
    else:
        kv = tl.load(kv_ptr + row_off[:, None] + offs_l[None, :], mask=n_ok[:, None], other=0.0)
        kpe = tl.load(
            kv_ptr + row_off[:, None] + D_LATENT + offs_r[None, :], mask=n_ok[:, None], other=0.0
        )
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return kv, kpe, scale, offs_n, n_ok


@triton.jit
def _split_heads_major_kernel(
    q_ptr, kv_ptr, kv16_ptr, kv32_ptr, pt_ptr, sl_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, qk_scale,
    stride_qb, stride_qq, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ob, stride_os, stride_oq, stride_oh,
    stride_lb, stride_ls, stride_lq, stride_lh,
    NUM_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax attention of BLOCK_M query rows over one chunk of one request's cache, with
    the query rows as the matrix M dimension: S = Q K^T [BLOCK_M, BLOCK_N], O += P V [BLOCK_M,
    D_LATENT].

    Cache strides are in bytes for an fp8 cache (kv_ptr: uint8, kv16_ptr / kv32_ptr: the same
    memory as bf16 and fp32), in elements otherwise. qk_scale = softmax_scale * log2(e). Writes
    the normalised output and the natural-log lse of the chunk (0 and -inf where the chunk holds
    nothing the row may see).
    """
    b, pid_s, row_ok, qi, h, visible, start, end = _split_prologue(
        sl_ptr, num_heads, num_rows, NUM_Q, NUM_SPLITS, BLOCK_M, BLOCK_N
    )
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + b * stride_qb + qi * stride_qq + h * stride_qh  # [BLOCK_M]
    q_lat = tl.load(q_row[:, None] + offs_l[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row[:, None] + D_LATENT + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
    pt_row = pt_ptr + b * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        kv, kpe, scale, offs_n, n_ok = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, q_lat.dtype,
        )  # fmt: skip
        if KV_FP8:
            qk = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION) * scale[None, :]
            qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision=DOT_PRECISION)
        else:
            qk = tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION)
            qk = tl.dot(
                q_lat, tl.trans(kv), qk, input_precision=DOT_PRECISION
            )  # [BLOCK_M, BLOCK_N]
        seen = (offs_n[None, :] < visible[:, None]) & n_ok[None, :]
        s = tl.where(seen, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            p = p * scale[None, :]  # values are c8 * scale: fold the scale into p
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_row = out_ptr + b * stride_ob + pid_s * stride_os + qi * stride_oq + h * stride_oh
    tl.store(
        o_row[:, None] + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
    )
    lse_row = lse_ptr + b * stride_lb + pid_s * stride_ls + qi * stride_lq + h * stride_lh
    tl.store(lse_row, lse, mask=row_ok)


@triton.jit
def _split_kv_major_kernel(
    q_ptr, kv_ptr, kv16_ptr, kv32_ptr, pt_ptr, sl_ptr, out_ptr, lse_ptr,
    num_heads, num_rows, qk_scale,
    stride_qb, stride_qq, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ob, stride_os, stride_oq, stride_oh,
    stride_lb, stride_ls, stride_lq, stride_lh,
    NUM_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The same computation as `_split_heads_major_kernel`, transposed so that cache positions are
    the matrix M dimension: S^T = K Q^T [BLOCK_N, BLOCK_M], O^T += V^T P^T [D_LATENT, BLOCK_M].
    With few query rows (16 heads) this keeps the tensor-core tiles full (M = 64 positions
    instead of 16 rows) and every operand in shared memory, so nothing large is held in registers
    but the accumulator."""
    b, pid_s, row_ok, qi, h, visible, start, end = _split_prologue(
        sl_ptr, num_heads, num_rows, NUM_Q, NUM_SPLITS, BLOCK_M, BLOCK_N
    )
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + b * stride_qb + qi * stride_qq + h * stride_qh  # [BLOCK_M]
    qt_lat = tl.load(
        q_row[None, :] + offs_l[:, None], mask=row_ok[None, :], other=0.0
    )  # [D_LATENT, M]
    qt_pe = tl.load(q_row[None, :] + D_LATENT + offs_r[:, None], mask=row_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([D_LATENT, BLOCK_M], tl.float32)
    pt_row = pt_ptr + b * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        kv, kpe, scale, offs_n, n_ok = _load_kv_tile(
            kv_ptr, kv16_ptr, kv32_ptr, pt_row, n0, end, stride_kvp, stride_kvr,
            PAGE_SIZE, D_LATENT, D_ROPE, KV_FP8, BLOCK_N, qt_lat.dtype,
        )  # fmt: skip
        if KV_FP8:
            st = tl.dot(kv, qt_lat, input_precision=DOT_PRECISION) * scale[:, None]
            st = tl.dot(kpe, qt_pe, st, input_precision=DOT_PRECISION)
        else:
            st = tl.dot(kpe, qt_pe, input_precision=DOT_PRECISION)
            st = tl.dot(kv, qt_lat, st, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        seen = (offs_n[:, None] < visible[None, :]) & n_ok[:, None]
        s = tl.where(seen, st * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        if KV_FP8:
            p = p * scale[:, None]  # values are c8 * scale: fold the scale into p
        acc = acc * alpha[None, :]
        acc = tl.dot(tl.trans(kv), p.to(kv.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[None, :]  # [D_LATENT, BLOCK_M]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_row = out_ptr + b * stride_ob + pid_s * stride_os + qi * stride_oq + h * stride_oh
    tl.store(
        o_row[None, :] + offs_l[:, None], out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :]
    )
    lse_row = lse_ptr + b * stride_lb + pid_s * stride_ls + qi * stride_lq + h * stride_lh
    tl.store(lse_row, lse, mask=row_ok)


_SPLIT_KERNELS = {"heads_major": _split_heads_major_kernel, "kv_major": _split_kv_major_kernel}


@triton.jit
def _mla_decode_combine_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_heads, num_rows,
    stride_ob, stride_oq, stride_oh, stride_lb, stride_lq, stride_lh,
    NUM_SPLITS: tl.constexpr, D_LATENT: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Merges the splits of BLOCK_M rows. part: [B, NUM_SPLITS, rows, D_LATENT] fp32; part_lse: [B,
    S, rows]."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    offs_l = tl.arange(0, D_LATENT)
    lse_base = part_lse_ptr + b * NUM_SPLITS * num_rows + rows  # [BLOCK_M]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_base + s * num_rows, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
    part_base = part_ptr + (b * NUM_SPLITS * num_rows + rows) * D_LATENT  # [BLOCK_M]
    for s in range(NUM_SPLITS):
        w = tl.exp(tl.load(lse_base + s * num_rows, mask=row_ok, other=float("-inf")) - m_safe)
        o = tl.load(
            part_base[:, None] + s * num_rows * D_LATENT + offs_l[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        denom += w
        acc += w[:, None] * o
    has = denom > 0.0
    d_safe = tl.where(has, denom, 1.0)
    qi = rows // num_heads
    h = rows % num_heads
    o_row = out_ptr + b * stride_ob + qi * stride_oq + h * stride_oh
    out = (acc / d_safe[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(o_row[:, None] + offs_l[None, :], out, mask=row_ok[:, None])
    lse = tl.where(has, m_safe + tl.log(d_safe), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + qi * stride_lq + h * stride_lh, lse, mask=row_ok)


@triton.jit
def _write_kv_fp8_kernel(
    c_ptr, kpe_ptr, slot_ptr, cache8_ptr, cache16_ptr, cache32_ptr,
    stride_c, stride_k, stride_page, stride_row,
    PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """Quantizes one token's row into the fp8 format at its slot. Cache strides are in bytes."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row_off = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_row
    row_off = tl.multiple_of(row_off, 16)
    offs_l = tl.arange(0, D_LATENT)
    offs_r = tl.arange(0, D_ROPE)
    c = tl.load(c_ptr + t * stride_c + offs_l).to(tl.float32)
    amax = tl.max(tl.abs(c), 0)
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    c8 = tl.clamp(tl.math.div_rn(c, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(cache8_ptr + row_off + offs_l, c8.to(tl.uint8, bitcast=True))
    kpe = tl.load(kpe_ptr + t * stride_k + offs_r).to(tl.bfloat16)
    off16 = tl.multiple_of((row_off + D_LATENT) // 2, 8)
    tl.store(cache16_ptr + off16 + offs_r, kpe)
    tl.store(cache32_ptr + (row_off + D_LATENT + 2 * D_ROPE) // 4, scale)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Q, H, Dk]; kv_cache: [num_pages, page_size, Dk] in q's dtype, or uint8 fp8 rows;
    page_table: [B, max_pages] int; seq_lens: [B] int. Returns out [B, Q, H, kv_lora_rank] (q's
    dtype), lse [B, Q, H] fp32."""
    return mla_decode_launch(q, kv_cache, page_table, seq_lens, softmax_scale, kv_lora_rank)


def mla_decode_launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` with the split count forced (None: the policy's choice) and entries of the tuned
    launch config overridden by `config`. For tests, benchmarks and tuning sweeps."""
    _check(q, kv_cache, page_table, seq_lens, kv_lora_rank)
    batch, num_q, num_heads, head_dim = q.shape
    rope_dim = head_dim - kv_lora_rank
    num_rows = num_q * num_heads
    out = torch.empty(batch, num_q, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0 or num_rows == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    is_fp8 = kv_cache.dtype == torch.uint8
    row_class = min(64, max(16, triton.next_power_of_2(num_rows)))
    cfg = tuning.lookup("mla_decode", f"{_CACHE_NAMES[kv_cache.dtype]},m{row_class}", q.device)
    if config is not None:
        cfg = {**cfg, **config}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    m_blocks = triton.cdiv(num_rows, block_m)
    page_size = kv_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, m_blocks, page_table.shape[1] * page_size, block_n, cfg, _num_sms(q.device)
        )
    if num_splits < 1:
        raise ValueError(f"mla_decode: num_splits={num_splits} must be >= 1")

    if is_fp8:
        kv8, kv16, kv32 = kv_cache, kv_cache.view(torch.bfloat16), kv_cache.view(torch.float32)
    else:
        kv8 = kv16 = kv32 = kv_cache
    if num_splits == 1:
        part, part_lse = out, lse
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), 0, lse.stride(1), lse.stride(2))
    else:
        part = torch.empty(
            batch, num_splits, num_q, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            batch, num_splits, num_q, num_heads, dtype=torch.float32, device=q.device
        )
        o_strides = part.stride()[:4]
        l_strides = part_lse.stride()
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _SPLIT_KERNELS[cfg["LAYOUT"]][(m_blocks, num_splits, batch)](
        q, kv8, kv16, kv32, page_table, seq_lens, part, part_lse,
        num_heads, num_rows, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0),
        *o_strides, *l_strides,
        NUM_Q=num_q, NUM_SPLITS=num_splits, PAGE_SIZE=page_size,
        D_LATENT=kv_lora_rank, D_ROPE=rope_dim, KV_FP8=is_fp8,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        combine_m = 16
        _mla_decode_combine_kernel[(triton.cdiv(num_rows, combine_m), batch)](
            part, part_lse, out, lse,
            num_heads, num_rows,
            *out.stride()[:3], *lse.stride(),
            NUM_SPLITS=num_splits, D_LATENT=kv_lora_rank, BLOCK_M=combine_m, num_warps=4,
        )  # fmt: skip
    return out, lse


def write_kv_fp8(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Quantizes T tokens' [c_kv | k_pe] into an fp8 cache [num_pages, page_size, row_bytes] uint8
    at flat slots (page * page_size + row), in place. Padding bytes of a row are left as they
    are."""
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8:
        raise ValueError(
            f"write_kv_fp8: kv_cache must be uint8 [P, S, row_bytes], got {kv_cache.dtype}"
        )
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"write_kv_fp8: c_kv [T, L] and k_pe [T, R] expected, got {tuple(c_kv.shape)}, "
            f"{tuple(k_pe.shape)}"
        )
    lora, rope = c_kv.shape[1], k_pe.shape[1]
    _check_dims(lora, rope, "write_kv_fp8")
    _check_fp8_cache(kv_cache, lora, rope, "write_kv_fp8")
    if slots.shape != (c_kv.shape[0],) or slots.dtype not in _INT_DTYPES:
        raise ValueError(f"write_kv_fp8: slots must be int [{c_kv.shape[0]}], got {slots.dtype}")
    for name, t in (("slots", slots), ("c_kv", c_kv), ("k_pe", k_pe)):
        if t.device != kv_cache.device:
            raise ValueError(f"write_kv_fp8: {name} on {t.device}, kv_cache on {kv_cache.device}")
    if c_kv.shape[0] == 0:
        return
    c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    _write_kv_fp8_kernel[(c_kv.shape[0],)](
        c_kv, k_pe, slots, kv_cache, kv_cache.view(torch.bfloat16), kv_cache.view(torch.float32),
        c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], D_LATENT=lora, D_ROPE=rope, FP8_MAX=fp8_format.FP8_E4M3_MAX,
        num_warps=4 if lora >= 512 else 1,
    )  # fmt: skip


def choose_num_splits(
    batch: int, m_blocks: int, max_seq_len: int, block_n: int, cfg: dict, num_sms: int
) -> int:
    """Splits per request: the fewest that fill the GPU's CTA slots in full waves (within 3% of the
    best fill), keeping at least MIN_TILES_PER_SPLIT tiles of BLOCK_N positions per split of the
    longest request."""
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    limit = max(1, min(cfg["MAX_SPLITS"], tiles // cfg["MIN_TILES_PER_SPLIT"]))
    slots = num_sms * cfg["CTAS_PER_SM"]
    ctas = batch * m_blocks

    def fill(s: int) -> float:
        total = ctas * s
        return total / (triton.cdiv(total, slots) * slots)

    best = max(fill(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if fill(s) >= best - 0.03)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_dims(lora: int, rope: int, op: str) -> None:
    for name, d in (("kv_lora_rank", lora), ("rope dims", rope)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{op}: {name}={d} must be a power of two >= 16")


def _check_fp8_cache(kv_cache: torch.Tensor, lora: int, rope: int, op: str) -> None:
    want = fp8_format.row_bytes(lora, rope)
    if kv_cache.shape[-1] != want:
        raise ValueError(
            f"{op}: fp8 cache rows are {kv_cache.shape[-1]} bytes, the format needs {want} "
            f"(kv_lora_rank={lora}, rope={rope})"
        )
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16:
        raise ValueError(
            f"{op}: fp8 cache strides {kv_cache.stride()} must be multiples of 16 bytes"
        )
    if kv_cache.data_ptr() % 16:
        raise ValueError(f"{op}: fp8 cache must start 16-byte aligned")


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    if q.dim() != 4 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"mla_decode: q must be float [B, Q, H, Dk], got {q.dtype} {tuple(q.shape)}"
        )
    batch, _, _, head_dim = q.shape
    _check_dims(kv_lora_rank, head_dim - kv_lora_rank, "mla_decode")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"mla_decode: kv_cache must be [P, page_size, D], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype == torch.uint8:
        _check_fp8_cache(kv_cache, kv_lora_rank, head_dim - kv_lora_rank, "mla_decode")
    elif kv_cache.dtype != q.dtype or kv_cache.shape[-1] != head_dim or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"mla_decode: kv_cache must be {q.dtype} [P, page_size, {head_dim}], unit stride last "
            f"(or uint8 fp8 rows), got {kv_cache.dtype} {tuple(kv_cache.shape)} {kv_cache.stride()}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype not in _INT_DTYPES:
        raise ValueError(
            f"mla_decode: page_table must be int [{batch}, max_pages], got {page_table.dtype} "
            f"{tuple(page_table.shape)}"
        )
    if seq_lens.shape != (batch,) or seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"mla_decode: seq_lens must be int [{batch}], got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    for name, t in (("kv_cache", kv_cache), ("page_table", page_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"mla_decode: {name} on {t.device}, q on {q.device}")
