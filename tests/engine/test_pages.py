"""PageAllocator: a request's pages come as one run while a free run is long enough, else as few runs as the free
space allows; single pages fill the lowest holes, frees held back during a forward pass come back after it,
misuse raises."""

from __future__ import annotations

import pytest

from pdserve.engine.pages import PageAllocator
from pdserve.model.errors import CapacityError


def test_requests_get_runs_and_single_pages_fill_the_lowest_holes():
    a = PageAllocator(20)
    first, second, third = a.allocate(4), a.allocate(5), a.allocate(3)
    assert (first, second, third) == ([0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11])
    a.free(second)  # a hole of 5 at 4..8
    assert a.allocate(6) == list(range(12, 18))  # does not fit the hole: the first run that fits
    assert a.allocate(1) == [4] and a.allocate(1) == [5]  # growth fills the hole from its low end
    assert a.allocate(3) == [6, 7, 8]
    assert (a.num_free, a.num_used) == (2, 18)


def test_no_run_long_enough_takes_the_longest_free_runs():
    a = PageAllocator(10)
    a.allocate(10)
    a.free([0, 2, 3, 4, 6, 7, 9])  # free runs of 1, 3, 2 and 1 pages
    assert a.allocate(5) == [
        2,
        3,
        4,
        6,
        7,
    ]  # two runs, where the lowest free pages would make three
    a = PageAllocator(8)
    a.allocate(8)
    a.free([1, 2, 5, 7])
    assert a.allocate(3) == [1, 2, 5]  # among runs of one page, the lowest first
    with pytest.raises(CapacityError, match="need 2 KV pages, 1 free of 8"):
        a.allocate(2)
    assert a.allocate(0) == [] and a.allocate(1) == [7] and a.num_free == 0


def test_frees_held_during_a_pass_come_back_after_it():
    a = PageAllocator(4)
    pages = a.allocate(4)
    a.hold_frees()
    a.free(pages[:2])
    assert (a.num_free, a.num_used) == (0, 2) and not a.can_allocate(1)
    a.release_held()
    assert a.num_free == 2 and a.allocate(2) == [0, 1]


def test_misuse_raises():
    with pytest.raises(ValueError, match="num_pages=0"):
        PageAllocator(0)
    a = PageAllocator(3)
    a.allocate(1)
    with pytest.raises(AssertionError, match="page 2 freed but not allocated"):
        a.free([2])
