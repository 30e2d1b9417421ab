"""Whole-page copies between a page-major KV cache and a packed tensor: the transfer's gather (P) and scatter (D),
for the pages that do not lie in one run.

`cache` is [num_pages, num_layers, page_size, dim], contiguous (the model's `PagedKVCache.data`): a page is one
contiguous block across its layers, and a run of consecutive page ids is one contiguous block, which the transfer
sends or receives in place (`run_view`). Pages that do not lie in a run are packed: [n, num_layers, page_size, dim]
in the order of `page_ids` (int64, on the cache's device). The copies are row gathers / scatters over the cache
seen as one row per page, in 8-byte words where the row allows.
"""

from __future__ import annotations

import array
import bisect

import torch


def device_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, built without a Python loop over them (torch.tensor on a list
    makes one Python object per value on the host)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    return host.to(device, non_blocking=True) if device.type != "cpu" else host


def run_start(page_ids: list[int]) -> int | None:
    """The first id when `page_ids` are consecutive ids in increasing order (one run), else None. (A list
    comparison, not a Python loop: this runs on every transfer's path.)"""
    if page_ids and page_ids[-1] - page_ids[0] == len(page_ids) - 1:
        first = page_ids[0]
        if page_ids == list(range(first, first + len(page_ids))):
            return first
    return None


def run_view(cache: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Pages [first, first + n) of the cache, in place: [n, num_layers, page_size, dim], contiguous."""
    return cache[first : first + n]


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row per page, in 8-byte words where a page allows."""
    if not cache.is_contiguous():
        raise ValueError("page copies need a contiguous cache")
    flat = cache.view(cache.shape[0], -1)
    if flat.shape[1] * flat.element_size() % 8 == 0 and flat.data_ptr() % 8 == 0:
        flat = flat.view(torch.int64)
    return flat


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pages `page_ids`, packed: a new tensor [n, num_layers, page_size, dim]."""
    packed = _rows(cache).index_select(0, page_ids)
    return packed.view(cache.dtype).view(len(page_ids), *cache.shape[1:])


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Writes `packed` [n, num_layers, page_size, dim] into the cache at pages `page_ids`."""
    if packed.shape != (len(page_ids), *cache.shape[1:]) or packed.dtype != cache.dtype:
        raise ValueError(
            f"packed pages {tuple(packed.shape)} {packed.dtype} do not fit {len(page_ids)} pages of the cache "
            f"{tuple(cache.shape)} {cache.dtype}"
        )
    flat = _rows(cache)
    flat.index_copy_(0, page_ids, packed.contiguous().view(len(page_ids), -1).view(flat.dtype))


def run_breaks(pages: list[int]) -> list[int]:
    """Indices i where pages[i] does not follow pages[i - 1]: a piece [a, b) lies in one run when none falls in
    (a, b). Empty for one run."""
    if run_start(pages) is not None:
        return []
    return [i for i in range(1, len(pages)) if pages[i] != pages[i - 1] + 1]


def check_pages(
    page_ids: list[int], num_pages: int, what: str, breaks: list[int] | None = None
) -> None:
    """The page copies index the cache without bounds checks on the device: check the ids here. `breaks`, when
    the caller has them (`run_breaks`), spare the scan of a run: its ends bound it."""
    if not page_ids:
        return
    if breaks == []:
        low, high = page_ids[0], page_ids[-1]
    else:
        low, high = min(page_ids), max(page_ids)
    if not (low >= 0 and high < num_pages):
        raise ValueError(f"{what}: page ids outside the cache's {num_pages} pages")


def in_run(breaks: list[int], a: int, b: int) -> bool:
    i = bisect.bisect_right(breaks, a)
    return i == len(breaks) or breaks[i] >= b
