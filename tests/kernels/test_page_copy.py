"""Whole-page gather and scatter (the KV transfer's copies), Triton and the reference, against plain torch
indexing of the cache. Copies are exact. The CPU cases run the kernel in the interpreter on small caches; a page
row longer than one block (page_size * dim > 1024) takes several programs per row."""

from __future__ import annotations

import pytest
import torch
from _decode_check import DEVICE, poisoned_empty

from pdserve.kernels.page_copy import ref
from pdserve.kernels.page_copy import triton as tri

CASES = [
    # layers, cache pages, page_size, dim, dtype, first, stop, n pages
    pytest.param(3, 10, 4, 24, torch.float32, 0, 3, 5, id="3L-row96-f32"),
    pytest.param(5, 9, 4, 576, torch.float16, 1, 4, 4, id="5L-row2304-f16-mid-layers"),
    pytest.param(2, 6, 1, 8, torch.float32, 1, 2, 6, id="all-pages-reordered"),
    pytest.param(
        27, 1024, 16, 576, torch.bfloat16, 0, 27, 512, marks=pytest.mark.gpu, id="v2lite-8k"
    ),
    pytest.param(
        61, 700, 64, 576, torch.bfloat16, 5, 61, 300, marks=pytest.mark.gpu, id="v3-page64"
    ),
]

IMPLS = [pytest.param(ref, id="ref"), pytest.param(tri, id="triton")]


def _setup(layers, num_pages, page_size, dim, dtype, n):
    g = torch.Generator().manual_seed(layers * num_pages + n)
    cache = torch.randn(layers, num_pages, page_size, dim, generator=g).to(dtype).to(DEVICE)
    ids = torch.randperm(num_pages, generator=g)[:n].to(DEVICE)
    return cache, ids


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layers,num_pages,page_size,dim,dtype,first,stop,n", CASES)
def test_gather_matches_indexing(impl, layers, num_pages, page_size, dim, dtype, first, stop, n):
    cache, ids = _setup(layers, num_pages, page_size, dim, dtype, n)
    with poisoned_empty():
        packed = impl.gather_pages(cache, first, stop, ids)
    assert packed.is_contiguous()
    assert torch.equal(packed, cache[first:stop][:, ids])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layers,num_pages,page_size,dim,dtype,first,stop,n", CASES)
def test_scatter_writes_those_pages_only(
    impl, layers, num_pages, page_size, dim, dtype, first, stop, n
):
    cache, ids = _setup(layers, num_pages, page_size, dim, dtype, n)
    packed = torch.randn(stop - first, n, page_size, dim).to(dtype).to(DEVICE)
    expected = cache.clone()
    expected[first:stop, ids] = packed
    impl.scatter_pages(cache, first, stop, ids, packed)
    assert torch.equal(cache, expected)


def test_round_trip_through_the_dispatcher():
    from pdserve import kernels

    cache, ids = _setup(4, 12, 2, 16, torch.float32, 7)
    dest = torch.zeros_like(cache)
    dest_ids = torch.randperm(12)[:7].to(DEVICE)
    kernels.scatter_pages(dest, 0, 4, dest_ids, kernels.gather_pages(cache, 0, 4, ids))
    assert torch.equal(dest[:, dest_ids], cache[:, ids])


def test_triton_rejects_page_ids_it_cannot_index_with():
    cache, ids = _setup(2, 6, 2, 8, torch.float32, 3)
    with pytest.raises(ValueError, match="int64"):
        tri.gather_pages(cache, 0, 2, ids.int())
    with pytest.raises(ValueError, match="do not fit"):
        tri.scatter_pages(cache, 0, 2, ids, torch.zeros(2, 3, 2, 9, device=DEVICE))
