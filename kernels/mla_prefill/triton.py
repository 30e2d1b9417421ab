"""MLA prefill attention in Triton: a flash-attention forward over a packed variable-length batch.

Same contract as `ref.mla_prefill` / `ref.merge_attn_states`. One program computes a BLOCK_M tile of
one sequence's queries for one head, streaming that sequence's keys in BLOCK_N tiles with an online
softmax in the log2 domain. The q/k head dim (192 = nope 128 + rope 64 for V3) is split into a
power-of-two part and a padded remainder, so the score tile is two chained dots. Causal masking is
bottom-right aligned (query i of a sequence with Lq queries and Lk keys sees keys j <= i + Lk - Lq):
key tiles every row of the query tile sees run in an unmasked loop, the diagonal tiles in a masked
one. Programs find their sequence by a binary search over the cumulative query-tile counts, so the
launch needs no host sync; within a sequence the heaviest (last) query tiles run first. fp32 inputs
use IEEE fp32 dots; fp16/bf16 use the tensor cores with fp32 accumulation. With `tma` in the tuned
entry (and contiguous k, v whose head dims are whole tiles) K and V tiles come through TMA
descriptors over [tokens, heads * dim].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._backend import tma_ok
from ..tuning import lookup

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_empty = torch.empty
"""Output allocator; tests replace it to poison outputs before the kernel writes them."""


@triton.jit
def _attend_tile(
    acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, start, offs_m, offs_n, offs_db, offs_dv,
    k_len, diag_off, stride_kt, stride_vt, qk_scale, k_row0, col_k, col_v,
    D_A: tl.constexpr, D_QK_B: tl.constexpr, D_B: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile: scores, online-softmax update, P @ V. MASKED tiles may hold keys past k_len or
    (CAUSAL) keys after a row's diagonal; unmasked tiles are fully visible to every row of the query
    tile. TMA: k_ptrs_a / k_ptrs_b / v_ptrs are descriptors over k and v as [tokens, heads * dim]
    (this head's columns start at col_k / col_v); rows past the sequence come from whatever follows
    it, so masked tiles zero those value rows (their scores are masked to -inf)."""
    keys = start + offs_n  # [BN]
    koff = keys.to(tl.int64)[:, None] * stride_kt  # [BN, 1] (pointer loads only)
    voff = keys.to(tl.int64)[:, None] * stride_vt
    if TMA:
        ka = k_ptrs_a.load([k_row0 + start, col_k])  # [BN, D_A]
        kb = k_ptrs_b.load([k_row0 + start, col_k + D_A])  # [BN, D_B]
        v = v_ptrs.load([k_row0 + start, col_v])  # [BN, BLOCK_DV]
        if MASKED:
            key_ok = keys < k_len
            v = tl.where(key_ok[:, None], v, 0.0)
    elif MASKED:
        key_ok = keys < k_len
        ka = tl.load(k_ptrs_a + koff, mask=key_ok[:, None], other=0.0)  # [BN, D_A]
        kb = tl.load(k_ptrs_b + koff, mask=key_ok[:, None] & (offs_db < D_QK_B)[None, :], other=0.0)
        v = tl.load(v_ptrs + voff, mask=key_ok[:, None] & (offs_dv < D_V)[None, :], other=0.0)
    else:
        ka = tl.load(k_ptrs_a + koff)
        if D_QK_B == D_B:
            kb = tl.load(k_ptrs_b + koff)
        else:
            kb = tl.load(k_ptrs_b + koff, mask=(offs_db < D_QK_B)[None, :], other=0.0)
        if D_V == BLOCK_DV:
            v = tl.load(v_ptrs + voff)
        else:
            v = tl.load(v_ptrs + voff, mask=(offs_dv < D_V)[None, :], other=0.0)
    s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PRECISION)  # [BM, BN] raw scores
    s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PRECISION)
    # m is kept in the scaled log2 domain; scaling inside exp2's argument makes one FMA per score.
    if MASKED:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + diag_off)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row that has seen no key keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr, k_ptr, kb_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, tiles_cum_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_lh, num_seqs, qk_scale,
    D_A: tl.constexpr, D_B: tl.constexpr, D_QK_B: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """TMA: k_ptr / kb_ptr are descriptors over k as [tokens, heads * D_QK] with blocks of D_A and
    D_B columns, v_ptr one over v as [tokens, heads * D_V]; otherwise kb_ptr is unused."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # This program's sequence: the first b with tiles_cum[b] > pid (inclusive cumsum of tiles).
    lo = pid * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(tiles_cum_ptr + tl.minimum(mid, num_seqs - 1)) <= pid
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    seq = lo
    if seq >= num_seqs:
        return
    tiles_before = tl.load(tiles_cum_ptr + seq - 1, mask=seq > 0, other=0)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
    k_start = tl.load(cu_k_ptr + seq).to(tl.int32)
    k_len = tl.load(cu_k_ptr + seq + 1).to(tl.int32) - k_start
    num_tiles = tl.cdiv(q_len, BLOCK_M)
    m0 = (num_tiles - 1 - (pid - tiles_before)) * BLOCK_M  # heaviest tile of the sequence first

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, D_A)
    offs_db = tl.arange(0, D_B)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    q_rows = q_ptr + head * stride_qh + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt
    qa = tl.load(q_rows + offs_da[None, :], mask=row_ok[:, None], other=0.0)  # [BM, D_A]
    qb = tl.load(
        q_rows + D_A + offs_db[None, :],
        mask=row_ok[:, None] & (offs_db < D_QK_B)[None, :],
        other=0.0,
    )  # [BM, D_B]
    if TMA:
        k_ptrs_a = k_ptr
        k_ptrs_b = kb_ptr
        v_ptrs = v_ptr
    else:
        k_base = k_ptr + head * stride_kh + k_start.to(tl.int64) * stride_kt
        k_ptrs_a = k_base + offs_da[None, :]  # [1, D_A]; + key offsets per tile
        k_ptrs_b = k_base + D_A + offs_db[None, :]
        v_ptrs = v_ptr + head * stride_vh + k_start.to(tl.int64) * stride_vt + offs_dv[None, :]
    col_k = head * stride_kh
    col_v = head * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    diag_off = k_len - q_len
    if CAUSAL:
        # keys [0, full_end) are visible to every row of the tile; [full_end, end) need the mask.
        full_end = tl.maximum(tl.minimum(k_len, m0 + diag_off + 1), 0)
        end = tl.maximum(tl.minimum(k_len, m0 + BLOCK_M + diag_off), 0)
    else:
        full_end = k_len
        end = k_len
    full_end = (full_end // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, start, offs_m, offs_n, offs_db,
            offs_dv, k_len, diag_off, stride_kt, stride_vt, qk_scale, k_start, col_k, col_v,
            D_A, D_QK_B, D_B, D_V, BLOCK_DV, False, CAUSAL, TMA, DOT_PRECISION,
        )  # fmt: skip
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, qa, qb, k_ptrs_a, k_ptrs_b, v_ptrs, start, offs_m, offs_n, offs_db,
            offs_dv, k_len, diag_off, stride_kt, stride_vt, qk_scale, k_start, col_k, col_v,
            D_A, D_QK_B, D_B, D_V, BLOCK_DV, True, CAUSAL, TMA, DOT_PRECISION,
        )  # fmt: skip

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that saw no key: acc is 0
    lse = tl.where(
        seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    rows = (q_start + offs_m).to(tl.int64)
    o_ptrs = out_ptr + head * stride_oh + rows[:, None] * stride_ot + offs_dv[None, :]
    tl.store(
        o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < D_V)[None, :]
    )
    tl.store(lse_ptr + head * stride_lh + rows * stride_lt, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_heads,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lt, stride_lh,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_DV)
    head_ok = heads < num_heads
    tile_ok = head_ok[:, None] & (dims < D_V)[None, :]
    la = tl.load(lse_a_ptr + t * stride_lat + heads * stride_lah, mask=head_ok, other=float("-inf"))
    lb = tl.load(lse_b_ptr + t * stride_lbt + heads * stride_lbh, mask=head_ok, other=float("-inf"))
    mx = tl.maximum(la, lb)
    finite = mx != float("-inf")
    mx_use = tl.where(finite, mx, 0.0)
    ea = tl.exp(la - mx_use)
    eb = tl.exp(lb - mx_use)
    total = tl.where(finite, ea + eb, 1.0)
    lse = tl.where(finite, mx_use + tl.log(total), float("-inf"))
    wa = tl.where(finite, ea / total, 0.0)[:, None]
    wb = tl.where(finite, eb / total, 0.0)[:, None]
    oa = tl.load(
        out_a_ptr + t * stride_at + heads[:, None] * stride_ah + dims[None, :], mask=tile_ok
    )
    ob = tl.load(
        out_b_ptr + t * stride_bt + heads[:, None] * stride_bh + dims[None, :], mask=tile_ok
    )
    out = oa.to(tl.float32) * wa + ob.to(tl.float32) * wb
    o_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)


def _check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim, got strides {tuple(x.stride())}"
        )


def _check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, dim], got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {x.dtype} unsupported; expected one of {_DTYPES}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
        _check_last_dim_contiguous(name, x)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != k head dim {k.shape[2]}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"head counts differ: q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries, cu_seqlens_k {cu_seqlens_k.numel()}"
        )
    if q.shape[2] < 16 or v.shape[2] < 16:
        raise ValueError(f"head dims must be >= 16, got qk {q.shape[2]}, v {v.shape[2]}")


def _split_head_dim(d_qk: int) -> tuple[int, int, int]:
    """(D_A, D_B, D_QK_B): a power-of-two part D_A, the remainder D_QK_B padded to D_B (>= 16)."""
    d_a = 1 << (d_qk.bit_length() - 1)
    rest = d_qk - d_a
    d_b = max(16, triton.next_power_of_2(rest)) if rest else 16
    return d_a, d_b, rest


_SHARED_MEMORY_BYTES = 224 * 1024  # sm_90 allows 227 KiB per block; keep a little for scratch


def _fit_shared_memory(
    block_m: int, block_n: int, num_stages: int, d_qk: int, d_v: int, elem_bytes: int
) -> tuple[int, int, int]:
    """Shrinks the tuned tiles (stages, then BLOCK_N, then BLOCK_M) until the q tile plus the
    pipelined K/V tiles fit in shared memory: the tuned entries are for V3's head dims; this keeps
    other head dims and dtypes launchable rather than failing to compile."""

    def need(bm: int, bn: int, stages: int) -> int:
        return (bm * d_qk + stages * bn * (d_qk + d_v)) * elem_bytes

    while need(block_m, block_n, num_stages) > _SHARED_MEMORY_BYTES:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return block_m, block_n, num_stages


def _tma_fits(k: torch.Tensor, v: torch.Tensor, whole_blocks: bool) -> bool:
    """Whether k and v can be read through TMA descriptors over their [tokens, heads * dim] rows:
    both contiguous, 16-byte aligned, non-empty, and the head dims whole blocks (D_QK_B == D_B,
    D_V a power of two) so that a box never reads into the next head's columns."""
    return whole_blocks and all(x.is_contiguous() and x.numel() > 0 and tma_ok(x) for x in (k, v))


def _search_steps(num_seqs: int) -> int:
    """Binary-search steps that find a program's sequence among `num_seqs`: at least 16 (extra steps are no-ops),
    so that a batch's count of prompts does not compile another kernel (up to 32767 prompts)."""
    return max(16, num_seqs.bit_length() + 1)


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.mla_prefill`. cu_seqlens_q[-1] must not exceed q's token count (nor cu_seqlens_k[-1]
    k's); rows of q past cu_seqlens_q[-1] are left unwritten."""
    _check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    num_tokens, num_heads, d_qk = q.shape
    d_v = v.shape[2]
    num_seqs = cu_seqlens_q.numel() - 1
    out = _empty((num_tokens, num_heads, d_v), dtype=q.dtype, device=q.device)
    lse = _empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_seqs == 0 or num_tokens == 0 or num_heads == 0:
        return out, lse
    cfg = lookup("mla_prefill", f"dtype={str(q.dtype).removeprefix('torch.')}", q.device)
    block_m, block_n, num_stages = _fit_shared_memory(
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], d_qk, d_v, q.element_size()
    )
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    tiles_cum = torch.cumsum((q_lens + block_m - 1) // block_m, 0).to(torch.int32)  # [B]
    d_a, d_b, d_qk_b = _split_head_dim(d_qk)
    block_dv = triton.next_power_of_2(d_v)
    tma = cfg.get("tma", False) and _tma_fits(k, v, d_qk_b == d_b and d_v == block_dv)
    if tma:
        k_arg = TensorDescriptor(k, [k.shape[0], k.stride(0)], [k.stride(0), 1], [block_n, d_a])
        kb_arg = TensorDescriptor(k, [k.shape[0], k.stride(0)], [k.stride(0), 1], [block_n, d_b])
        v_arg = TensorDescriptor(v, [v.shape[0], v.stride(0)], [v.stride(0), 1], [block_n, d_v])
    else:
        k_arg, kb_arg, v_arg = k, k, v
    grid = (triton.cdiv(num_tokens, block_m) + num_seqs, num_heads)
    _mla_prefill_kernel[grid](
        q, k_arg, kb_arg, v_arg, out, lse, cu_seqlens_q, cu_seqlens_k, tiles_cum,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_seqs, softmax_scale * LOG2E,
        D_A=d_a, D_B=d_b, D_QK_B=d_qk_b, D_V=d_v, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, SEARCH_STEPS=_search_steps(num_seqs),
        CAUSAL=bool(causal), TMA=tma, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=num_stages,
    )  # fmt: skip
    return out, lse


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ref.merge_attn_states`. Returns out in out_a's dtype and lse fp32."""
    if out_a.dim() != 3 or out_b.shape != out_a.shape:
        raise ValueError(
            f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)}: expected equal [T, H, Dv]"
        )
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise ValueError(
            f"lse_a {tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)}: "
            f"expected {tuple(out_a.shape[:2])}"
        )
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise ValueError(f"lse must be fp32, got {lse_a.dtype} and {lse_b.dtype}")
    if out_a.dtype not in _DTYPES or out_b.dtype not in _DTYPES:
        raise ValueError(f"out dtypes {out_a.dtype}, {out_b.dtype} unsupported")
    for name, x in (("out_b", out_b), ("lse_a", lse_a), ("lse_b", lse_b)):
        if x.device != out_a.device:
            raise ValueError(f"{name} is on {x.device}, out_a on {out_a.device}")
    _check_last_dim_contiguous("out_a", out_a)
    _check_last_dim_contiguous("out_b", out_b)
    num_tokens, num_heads, d_v = out_a.shape
    out = _empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = _empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        return out, lse
    block_dv = triton.next_power_of_2(d_v)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // block_dv))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse, num_heads,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1),
        out.stride(0), out.stride(1), lse_a.stride(0), lse_a.stride(1),
        lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
        D_V=d_v, BLOCK_H=block_h, BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip
    return out, lse
