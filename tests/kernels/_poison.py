"""Test helper: make every `torch.empty` inside a block return poisoned memory (NaN for floats, a
huge value for integers), so a kernel that leaves part of an output unwritten, or reads scratch it
never wrote, shows up as NaN or a wild value instead of passing on stale zeros."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_POISON_INT = 0x3FFFFFF7


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(_POISON_INT)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN when out has NaN)."""
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
