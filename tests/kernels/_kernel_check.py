"""Test helper: makes a Triton launcher allocate its outputs pre-filled with poison (NaN for floats,
-1 for integers), so any element the kernel fails to write shows up in the comparison."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def _poisoned_empty(*size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    out = torch.empty(*size, dtype=dtype, device=device)
    return out.fill_(float("nan") if dtype.is_floating_point else -1)


def poison_outputs(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """Replace `module._empty` (the launcher's output allocator) for the duration of the test."""
    monkeypatch.setattr(module, "_empty", _poisoned_empty)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when actual has NaN or inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
