"""SwiGLU's activation silu(gate) * up, optionally quantized for the next fp8 GEMM: Triton or the torch
reference."""

from __future__ import annotations

import torch

from .._backend import implementation


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, quant: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See `ref.silu_mul` for the contract."""
    return implementation(__name__, gate).silu_mul(gate, up, quant)


__all__ = ["silu_mul"]
