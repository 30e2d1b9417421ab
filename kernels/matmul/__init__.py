"""Dense matmuls (projections, the router, the absorbed-MLA head products). By default they run in
torch (cuBLAS on a GPU, whose kernel choice, split-K included, follows the batch size). In
batch-invariant mode (`kernels.use_batch_invariant`, `PDSERVE_BATCH_INVARIANT=1`) and where the
dispatcher picks Triton, they run in `triton.py`'s kernel, whose launch config and split of K depend
on the weight's shape only, so a row's result is the same in any batch."""

from __future__ import annotations

import importlib

import torch

from .._backend import backend_for, batch_invariant, implementation


def _impl(x: torch.Tensor):
    name = "triton" if batch_invariant() and backend_for(x) == "triton" else "ref"
    return importlib.import_module(f"{__name__}.{name}")


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """See `ref.linear` for the contract."""
    return _impl(x).linear(x, w, out_dtype)


def head_matmul(
    x: torch.Tensor, w: torch.Tensor, quant: bool = False, out: torch.Tensor | None = None
):
    """See `ref.head_matmul` for the contract. Quantized, it runs in Triton wherever the dispatcher picks
    Triton (the product and the quantization in one kernel), in torch otherwise."""
    if quant:
        return implementation(__name__, x).head_matmul(x, w, quant=True, out=out)
    return _impl(x).head_matmul(x, w, out=out)


__all__ = ["head_matmul", "linear"]
