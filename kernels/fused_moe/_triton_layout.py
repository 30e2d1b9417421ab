"""Row layout for the fused MoE in Triton: which rows of the grouped GEMMs belong to which expert.

`align_rows` counts each expert's assignments and lays them out expert after expert, each
expert's run padded to a multiple of BLOCK_M rows: `sorted_ids[row]` is the flat assignment t*k+j
(T*k on a padding row), `ends[e]` the end of expert e's rows, `row_of[t*k+j]` the row of an
assignment (-1 when its id is outside [0, E)). Up to ONE_PROGRAM_MAX_ASSIGNMENTS assignments one
program lays them out, each run in assignment order; above, order within a run follows atomics.
Results do not depend on it.
`permute_rows` copies x into that layout (quantized to fp8 on the way when asked), so the gate/up
GEMM can read its A tiles contiguously through TMA instead of gathering token rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import interpreter_enabled
from ..fp8_quant import ACT_QUANT_GROUP, FP8_E4M3_MAX, MIN_AMAX
from ..fp8_quant_triton import quantize_tile

# Up to this many (token, expert) assignments one program lays the rows out (`align_rows`): one
# launch instead of a memset and three. Its work grows as assignments x experts.
ONE_PROGRAM_MAX_ASSIGNMENTS = 256


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, numel, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (e >= 0) & (e < num_experts)
    tl.atomic_add(counts_ptr + e, 1, mask=valid)


@triton.jit
def _offsets_kernel(
    counts_ptr, starts_ptr, ends_ptr, sorted_ids_ptr, num_experts, sentinel,
    BLOCK_M: tl.constexpr, E_CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: padded prefix sums of the counts (starts, ends); sentinels on padding rows."""
    running = 0
    r = tl.arange(0, BLOCK_M)
    for e0 in range(0, num_experts, E_CHUNK):
        e = e0 + tl.arange(0, E_CHUNK)
        in_range = e < num_experts
        count = tl.load(counts_ptr + e, mask=in_range, other=0)
        padded = tl.cdiv(count, BLOCK_M) * BLOCK_M
        end = running + tl.cumsum(padded, axis=0)
        start = end - padded
        tl.store(starts_ptr + e, start, mask=in_range)
        tl.store(ends_ptr + e, end, mask=in_range)
        pad_rows = (start + count)[:, None] + r[None, :]
        pad_mask = in_range[:, None] & (r[None, :] < (padded - count)[:, None])
        pad_ids = tl.full(pad_rows.shape, sentinel, tl.int32)
        tl.store(sorted_ids_ptr + pad_rows, pad_ids, mask=pad_mask)
        running += tl.sum(padded, axis=0)


@triton.jit
def _scatter_kernel(
    ids_ptr, cursor_ptr, starts_ptr, sorted_ids_ptr, row_of_ptr, numel, num_experts,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < numel
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (e >= 0) & (e < num_experts)
    e = tl.where(valid, e, 0)
    rank = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    row = tl.load(starts_ptr + e, mask=valid, other=0) + rank
    tl.store(sorted_ids_ptr + row, offs, mask=valid)
    tl.store(row_of_ptr + offs, tl.where(valid, row, -1), mask=in_range)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, sorted_ids_ptr, ends_ptr, row_of_ptr, numel, num_experts,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, E_CHUNK: tl.constexpr,
):  # fmt: skip
    """Small batches: count, offsets and scatter in one program, with no atomics and no zeroed
    scratch. Each chunk of experts takes a [assignments, experts] one-hot matrix: its column sums
    are the counts, and its running sum down the assignments gives each assignment's rank among
    its expert's, so each run keeps assignment order. The ids are read once."""
    i = tl.arange(0, BLOCK)
    in_range = i < numel
    e_i = tl.load(ids_ptr + i, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (e_i >= 0) & (e_i < num_experts)
    e_i = tl.where(valid, e_i, -1)  # -1 matches no expert
    row = tl.zeros([BLOCK], dtype=tl.int32)
    running = 0
    r = tl.arange(0, BLOCK_M)
    for e0 in range(0, num_experts, E_CHUNK):
        e = e0 + tl.arange(0, E_CHUNK)
        in_e = e < num_experts
        mine = (e_i[:, None] == e[None, :]).to(tl.int32)  # [BLOCK, E_CHUNK]
        count = tl.sum(mine, axis=0)
        padded = tl.cdiv(count, BLOCK_M) * BLOCK_M
        end = running + tl.cumsum(padded, axis=0)
        e_start = end - padded
        tl.store(ends_ptr + e, end, mask=in_e)
        pad_rows = (e_start + count)[:, None] + r[None, :]
        pad_mask = in_e[:, None] & (r[None, :] < (padded - count)[:, None])
        tl.store(sorted_ids_ptr + pad_rows, tl.full(pad_rows.shape, numel, tl.int32), mask=pad_mask)
        rank = tl.cumsum(mine, axis=0) - 1  # earlier assignments to the same expert
        row += tl.sum(tl.where(mine != 0, e_start[None, :] + rank, 0), axis=1)
        running += tl.sum(padded, axis=0)
    tl.store(sorted_ids_ptr + row, i, mask=valid)
    tl.store(row_of_ptr + i, tl.where(valid, row, -1), mask=in_range)


@triton.jit
def _permute_rows_kernel(
    x_ptr, out_ptr, outs_ptr, sorted_ids_ptr, ends_ptr,
    num_experts, num_assignments, top_k, hidden,
    stride_xm, stride_om, stride_osm, stride_osg,
    QUANT: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, EXACT_CAST: tl.constexpr,
):  # fmt: skip
    """out[row] = x[token of row] (zeros on padding rows), quantized in 1x128 groups when QUANT:
    the gate/up GEMM then reads its A tiles contiguously (through TMA) instead of gathering."""
    row0 = tl.program_id(0) * BLOCK_R
    total = tl.load(ends_ptr + num_experts - 1)
    if row0 >= total:
        return
    rows = row0 + tl.arange(0, BLOCK_R)
    ids = tl.load(sorted_ids_ptr + rows, mask=rows < total, other=num_assignments)
    valid = ids < num_assignments
    tok = tl.where(valid, ids // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    col_mask = cols < hidden
    in_mask = valid[:, None] & col_mask[None, :]
    v = tl.load(x_ptr + tok[:, None] * stride_xm + cols[None, :], mask=in_mask, other=0.0)
    out_mask = (rows < total)[:, None] & col_mask[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if QUANT:
        q, scale = quantize_tile(v.to(tl.float32), FP8_MAX, MIN_AMAX, EXACT_CAST)
        tl.store(out_ptrs, q, mask=out_mask)
        s_ptrs = outs_ptr + rows * stride_osm + tl.program_id(1) * stride_osg
        tl.store(s_ptrs, scale, mask=rows < total)
    else:
        tl.store(out_ptrs, v, mask=out_mask)


def align_rows(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Step 1. Returns sorted_ids [max_rows] int32, ends [E] int32, row_of [T*k] int32 and max_rows
    (a multiple of block_m bounding the padded total). Rows past ends[E-1] are never written."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    numel = ids.numel()
    max_rows = triton.cdiv(numel + min(num_experts, numel) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    row_of = torch.empty(numel, dtype=torch.int32, device=device)
    if numel <= ONE_PROGRAM_MAX_ASSIGNMENTS:  # decode: one launch instead of a memset and three
        ends = torch.empty(num_experts, dtype=torch.int32, device=device)
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, ends, row_of, numel, num_experts,
            BLOCK_M=block_m, BLOCK=max(16, triton.next_power_of_2(numel)), E_CHUNK=16,
            num_warps=4,
        )  # fmt: skip
        return sorted_ids, ends, row_of, max_rows
    scratch = torch.zeros(4 * num_experts, dtype=torch.int32, device=device)
    counts, cursor, starts, ends = scratch.view(4, num_experts)
    block = 1024
    grid = (triton.cdiv(numel, block),)
    _count_kernel[grid](ids, counts, numel, num_experts, BLOCK=block, num_warps=4)
    _offsets_kernel[(1,)](
        counts, starts, ends, sorted_ids, num_experts, numel,
        BLOCK_M=block_m, E_CHUNK=16, num_warps=4,
    )  # fmt: skip
    _scatter_kernel[grid](
        ids, cursor, starts, sorted_ids, row_of, numel, num_experts, BLOCK=block, num_warps=4
    )
    return sorted_ids, ends, row_of, max_rows


def permute_rows(
    x: torch.Tensor,
    sorted_ids: torch.Tensor,
    ends: torch.Tensor,
    num_assignments: int,
    top_k: int,
    max_rows: int,
    quant: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x laid out by row ([max_rows, D]; fp8 with column-major [max_rows, D/128] scales when
    quant). Rows past the padded total stay unwritten; the GEMM never reads them."""
    hidden = x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    group = ACT_QUANT_GROUP if quant else min(256, triton.next_power_of_2(hidden))
    dtype = torch.float8_e4m3fn if quant else x.dtype
    out = torch.empty((max_rows, hidden), dtype=dtype, device=x.device)
    num_groups = triton.cdiv(hidden, group)
    scales = torch.empty((num_groups, max_rows), dtype=torch.float32, device=x.device).t()
    block_r = 32
    _permute_rows_kernel[(triton.cdiv(max_rows, block_r), num_groups)](
        x, out, scales, sorted_ids, ends, ends.numel(), num_assignments, top_k, hidden,
        x.stride(0), out.stride(0), scales.stride(0), scales.stride(1),
        QUANT=quant, BLOCK_R=block_r, GROUP=group, FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX,
        EXACT_CAST=interpreter_enabled(), num_warps=4,
    )  # fmt: skip
    return out, scales
