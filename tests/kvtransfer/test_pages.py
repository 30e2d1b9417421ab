"""Whole-page gather and scatter (the KV transfer's copies) against plain torch indexing of the cache: exact, in
8-byte words where a page row allows and in elements otherwise."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvtransfer.pages import device_ids, gather_pages, scatter_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # layers, cache pages, page_size, dim, dtype, first, stop, n pages
    pytest.param(3, 10, 4, 24, torch.float32, 0, 3, 5, id="3L-row96-f32"),
    pytest.param(5, 9, 4, 576, torch.float16, 1, 4, 4, id="5L-row2304-f16-mid-layers"),
    pytest.param(2, 6, 1, 8, torch.float32, 1, 2, 6, id="all-pages-reordered"),
    pytest.param(3, 7, 1, 3, torch.bfloat16, 0, 3, 4, id="row-of-6-bytes-elementwise"),
    pytest.param(
        27, 1024, 16, 576, torch.bfloat16, 0, 27, 512, marks=pytest.mark.gpu, id="v2lite-8k"
    ),
    pytest.param(
        61, 700, 64, 576, torch.bfloat16, 5, 61, 300, marks=pytest.mark.gpu, id="v3-page64"
    ),
]


def _setup(layers, num_pages, page_size, dim, dtype, n):
    g = torch.Generator().manual_seed(layers * num_pages + n)
    cache = torch.randn(layers, num_pages, page_size, dim, generator=g).to(dtype).to(DEVICE)
    ids = torch.randperm(num_pages, generator=g)[:n].to(DEVICE)
    return cache, ids


@pytest.mark.parametrize("layers,num_pages,page_size,dim,dtype,first,stop,n", CASES)
def test_gather_matches_indexing(layers, num_pages, page_size, dim, dtype, first, stop, n):
    cache, ids = _setup(layers, num_pages, page_size, dim, dtype, n)
    packed = gather_pages(cache, first, stop, ids)
    assert packed.is_contiguous()
    assert torch.equal(packed, cache[first:stop][:, ids])


@pytest.mark.parametrize("layers,num_pages,page_size,dim,dtype,first,stop,n", CASES)
def test_scatter_writes_those_pages_only(layers, num_pages, page_size, dim, dtype, first, stop, n):
    cache, ids = _setup(layers, num_pages, page_size, dim, dtype, n)
    packed = torch.randn(stop - first, n, page_size, dim).to(dtype).to(DEVICE)
    expected = cache.clone()
    expected[first:stop, ids] = packed
    scatter_pages(cache, first, stop, ids, packed)
    assert torch.equal(cache, expected)


def test_round_trip_with_ids_from_a_list():
    cache, ids = _setup(4, 12, 2, 16, torch.float32, 7)
    dest = torch.zeros_like(cache)
    dest_ids = device_ids([11, 0, 5, 3, 2, 9, 8], torch.device(DEVICE))
    assert dest_ids.dtype == torch.int64 and dest_ids.tolist() == [11, 0, 5, 3, 2, 9, 8]
    scatter_pages(dest, 0, 4, dest_ids, gather_pages(cache, 0, 4, ids))
    assert torch.equal(dest[:, dest_ids], cache[:, ids])


def test_packed_pages_that_do_not_fit_are_refused():
    cache, ids = _setup(2, 6, 2, 8, torch.float32, 3)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_pages(cache, 0, 2, ids, torch.zeros(2, 3, 2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gather_pages(cache.transpose(0, 1), 0, 2, ids)
