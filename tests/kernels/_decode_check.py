"""Helpers for the decode-side kernel tests: poisoned output allocation, a norm-wise relative error,
the device the tests run on.

Interpreter traps seen with Triton 3.9 on CPU (TRITON_INTERPRET=1), which is why the CPU cases use
fp32 and fp16 and exactly representable fp8 inputs: `tl.dot` on bf16 operands is wrong; fp32 -> bf16
casts truncate instead of rounding to nearest even; fp32 -> fp8e4nv casts lose the carry when the
mantissa rounds up into the next binade (127.9 -> 64 instead of 128)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Within the block, `torch.empty` / `torch.empty_like` return memory filled with NaN (floats)
    or 0x5A bytes (everything else), so an element a kernel leaves unwritten shows up in the
    check."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.view(torch.uint8).fill_(0x5A).view(t.dtype) if t.numel() else t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when actual has a NaN or inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()
