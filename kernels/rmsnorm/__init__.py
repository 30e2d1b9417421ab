"""RMSNorm (+ fused residual add): dispatches to Triton or the torch reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: bool | str = False,
):
    """See `ref.rmsnorm` for the contract."""
    return implementation(__name__, x).rmsnorm(x, weight, eps, residual, quant)


__all__ = ["rmsnorm"]
