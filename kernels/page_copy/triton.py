"""Whole-page gather and scatter in Triton: same contract as `ref`.

Torch's index_select / index_copy_ along the page axis run at a third of the copy bandwidth or less on an H200
(benchmarks/RESULTS.md); here each program copies one BLOCK-long stretch of one page row (page_size * dim values,
contiguous on both sides), so the kernel is a plain copy with a computed row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _page_copy_kernel(
    cache_ptr, packed_ptr, ids_ptr, n, cache_pages, row_len,
    GATHER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)  # packed row: layer r // n (from `first`), page r % n
    page = tl.load(ids_ptr + r % n)
    cache_row = (r // n).to(tl.int64) * cache_pages + page
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_len
    cache_at = cache_ptr + cache_row * row_len + offs
    packed_at = packed_ptr + r.to(tl.int64) * row_len + offs
    if GATHER:
        tl.store(packed_at, tl.load(cache_at, mask=mask), mask=mask)
    else:
        tl.store(cache_at, tl.load(packed_at, mask=mask), mask=mask)


def _launch(cache, first, stop, page_ids, packed, gather: bool) -> None:
    if not cache.is_contiguous() or not packed.is_contiguous():
        raise ValueError("page copies need a contiguous cache and packed tensor")
    if page_ids.dtype != torch.int64 or page_ids.device != cache.device:
        raise ValueError(
            f"page_ids must be int64 on {cache.device}, got {page_ids.dtype} on {page_ids.device}"
        )
    k, n = stop - first, len(page_ids)
    if k <= 0 or n == 0:
        return
    row_len = cache.shape[2] * cache.shape[3]
    block = min(_BLOCK, triton.next_power_of_2(row_len))
    grid = (k * n, triton.cdiv(row_len, block))
    _page_copy_kernel[grid](
        cache[first:stop], packed, page_ids, n, cache.shape[1], row_len,
        GATHER=gather, BLOCK=block, num_warps=4,
    )  # fmt: skip


def gather_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor
) -> torch.Tensor:
    packed = torch.empty(
        (stop - first, len(page_ids), *cache.shape[2:]), dtype=cache.dtype, device=cache.device
    )
    _launch(cache, first, stop, page_ids, packed, gather=True)
    return packed


def scatter_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor, packed: torch.Tensor
) -> None:
    if (
        packed.shape != (stop - first, len(page_ids), *cache.shape[2:])
        or packed.dtype != cache.dtype
    ):
        raise ValueError(
            f"packed pages {tuple(packed.shape)} {packed.dtype} do not fit the cache {cache.dtype}"
        )
    _launch(cache, first, stop, page_ids, packed, gather=False)
