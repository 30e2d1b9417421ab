"""Whole-page gather and scatter (the KV transfer's copies) of a page-major cache against plain torch indexing:
exact, in 8-byte words where a page allows and in elements otherwise; page runs seen in place."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvtransfer.pages import device_ids, gather_pages, run_start, run_view, scatter_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # cache pages, layers, page_size, dim, dtype, n pages
    pytest.param(10, 3, 4, 24, torch.float32, 5, id="3L-row96-f32"),
    pytest.param(9, 5, 4, 576, torch.float16, 4, id="5L-row2304-f16"),
    pytest.param(6, 2, 1, 8, torch.float32, 6, id="all-pages-reordered"),
    pytest.param(7, 3, 1, 1, torch.bfloat16, 4, id="page-of-6-bytes-elementwise"),
    pytest.param(1024, 27, 16, 576, torch.bfloat16, 512, marks=pytest.mark.gpu, id="v2lite-8k"),
    pytest.param(700, 61, 64, 576, torch.bfloat16, 300, marks=pytest.mark.gpu, id="v3-page64"),
]


def _setup(num_pages, layers, page_size, dim, dtype, n):
    g = torch.Generator().manual_seed(layers * num_pages + n)
    cache = torch.randn(num_pages, layers, page_size, dim, generator=g).to(dtype).to(DEVICE)
    ids = torch.randperm(num_pages, generator=g)[:n].to(DEVICE)
    return cache, ids


@pytest.mark.parametrize("num_pages,layers,page_size,dim,dtype,n", CASES)
def test_gather_matches_indexing(num_pages, layers, page_size, dim, dtype, n):
    cache, ids = _setup(num_pages, layers, page_size, dim, dtype, n)
    packed = gather_pages(cache, ids)
    assert packed.is_contiguous()
    assert torch.equal(packed, cache[ids])


@pytest.mark.parametrize("num_pages,layers,page_size,dim,dtype,n", CASES)
def test_scatter_writes_those_pages_only(num_pages, layers, page_size, dim, dtype, n):
    cache, ids = _setup(num_pages, layers, page_size, dim, dtype, n)
    packed = torch.randn(n, layers, page_size, dim).to(dtype).to(DEVICE)
    expected = cache.clone()
    expected[ids] = packed
    scatter_pages(cache, ids, packed)
    assert torch.equal(cache, expected)


def test_scatter_rejects_a_packed_tensor_of_another_shape():
    cache, ids = _setup(8, 2, 2, 4, torch.float32, 3)
    with pytest.raises(ValueError, match="do not fit 3 pages"):
        scatter_pages(cache, ids, torch.zeros(3, 2, 2, 5, device=DEVICE))


def test_round_trip_with_ids_from_a_list():
    cache, ids = _setup(12, 4, 2, 16, torch.float32, 7)
    dest = torch.zeros_like(cache)
    dest_ids = device_ids([11, 0, 5, 3, 2, 9, 8], torch.device(DEVICE))
    assert dest_ids.dtype == torch.int64 and dest_ids.tolist() == [11, 0, 5, 3, 2, 9, 8]
    scatter_pages(dest, dest_ids, gather_pages(cache, ids))
    assert torch.equal(dest[dest_ids], cache[ids])


def test_runs_are_seen_in_place():
    cache, _ = _setup(12, 3, 2, 8, torch.float32, 1)
    assert run_start([4, 5, 6]) == 4 and run_start([7]) == 7
    assert run_start([4, 6, 5]) is None and run_start([4, 5, 7]) is None and run_start([]) is None
    view = run_view(cache, 4, 3)
    assert view.is_contiguous() and view.data_ptr() == cache[4].data_ptr()
    assert torch.equal(view, gather_pages(cache, device_ids([4, 5, 6], torch.device(DEVICE))))
