"""Whole-page copies between a paged KV cache and a packed tensor: the transfer's gather (P) and scatter (D).

`cache` is [num_layers, num_pages, page_size, dim], contiguous (the model's `PagedKVCache.data`); a packed tensor
holds layers [first, stop) of n pages in the order of `page_ids` (int64, on the cache's device): [stop - first, n,
page_size, dim], contiguous. The copies run as row gathers / scatters over the cache seen as rows of one page of
one layer, in 8-byte words where the row allows: torch's index_copy_ along the page axis of a bf16 cache runs at
a third of copy speed on an H200, as 8-byte words at copy speed, with a host cost of a few microseconds (a Triton
kernel matched the speed at three times the launch cost; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import array

import torch


def device_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, built without a Python loop over them (torch.tensor on a list
    of 500 ints costs ~70 us of host time; this ~15)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    return host.to(device, non_blocking=True) if device.type != "cpu" else host


def _rows(cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor):
    """Layers [first, stop) of the cache as rows [k * num_pages, row words], and the rows of the pages."""
    if not cache.is_contiguous():
        raise ValueError("page copies need a contiguous cache")
    k, num_pages = stop - first, cache.shape[1]
    flat = cache[first:stop].view(k * num_pages, -1)
    if flat.shape[1] * flat.element_size() % 8 == 0 and flat.data_ptr() % 8 == 0:
        flat = flat.view(torch.int64)
    layer_base = torch.arange(k, device=cache.device, dtype=torch.int64)[:, None] * num_pages
    return flat, (layer_base + page_ids[None, :]).flatten()


def gather_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor
) -> torch.Tensor:
    """Layers [first, stop) of pages `page_ids`, packed: a new tensor [stop - first, n, page_size, dim]."""
    flat, rows = _rows(cache, first, stop, page_ids)
    packed = flat.index_select(0, rows)
    return packed.view(cache.dtype).view(stop - first, len(page_ids), *cache.shape[2:])


def scatter_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor, packed: torch.Tensor
) -> None:
    """Writes `packed` [stop - first, n, page_size, dim] into layers [first, stop) of the cache at `page_ids`."""
    if (
        packed.shape != (stop - first, len(page_ids), *cache.shape[2:])
        or packed.dtype != cache.dtype
    ):
        raise ValueError(
            f"packed pages {tuple(packed.shape)} {packed.dtype} do not fit layers [{first}, {stop}) of "
            f"{len(page_ids)} pages of the cache {tuple(cache.shape)} {cache.dtype}"
        )
    flat, rows = _rows(cache, first, stop, page_ids)
    flat.index_copy_(0, rows, packed.contiguous().view(len(rows), -1).view(flat.dtype))
