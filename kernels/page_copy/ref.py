"""Whole-page copies between a paged KV cache and a packed tensor, the KV transfer's gather and scatter (torch
reference, the spec).

`cache` is [num_layers, num_pages, page_size, dim], contiguous (the model's `PagedKVCache.data`); a packed tensor
holds layers [first, stop) of n pages in the order of `page_ids` (int64, on the cache's device): [stop - first, n,
page_size, dim], contiguous. Page ids are not bounds-checked on the device: callers check them on the host.
"""

from __future__ import annotations

import torch


def _rows(cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor):
    """Layers [first, stop) of the cache as rows [k * num_pages, page_size * dim], and the rows of the pages."""
    k, num_pages = stop - first, cache.shape[1]
    flat = cache[first:stop].view(k * num_pages, -1)
    layer_base = torch.arange(k, device=cache.device, dtype=torch.int64)[:, None] * num_pages
    return flat, (layer_base + page_ids[None, :]).flatten()


def gather_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor
) -> torch.Tensor:
    """Layers [first, stop) of pages `page_ids`, packed: a new tensor [stop - first, n, page_size, dim]."""
    flat, rows = _rows(cache, first, stop, page_ids)
    return flat.index_select(0, rows).view(stop - first, len(page_ids), *cache.shape[2:])


def scatter_pages(
    cache: torch.Tensor, first: int, stop: int, page_ids: torch.Tensor, packed: torch.Tensor
) -> None:
    """Writes `packed` [stop - first, n, page_size, dim] into layers [first, stop) of the cache at `page_ids`."""
    flat, rows = _rows(cache, first, stop, page_ids)
    flat.index_copy_(0, rows, packed.reshape(len(rows), -1))
