"""Triton rmsnorm (+ fused residual add) against the torch reference.

Tolerances: the new residual (x + residual, rounded once to the residual's dtype: x's, or fp32 for
the model's fp32 residual stream) must match exactly; the
normalised output within 2 units in the last place of its dtype, relative (the kernel's sum of
squares runs in another order, which can flip one rounding of x * rstd). On CPU the kernel runs in
the interpreter, so CPU cases are fp32 / fp16; bf16 and DeepSeek-V3 widths are GPU cases."""

from __future__ import annotations

import pytest
import torch
from _decode_check import DEVICE, assert_quantized_close, poisoned_empty

from pdserve.kernels.rmsnorm import ref
from pdserve.kernels.rmsnorm import triton as tri

ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

CASES = [
    pytest.param(1, 48, torch.float32, id="1x48-f32"),
    pytest.param(7, 100, torch.float16, id="7x100-f16"),
    pytest.param(5, 512, torch.float32, id="5x512-f32"),
    pytest.param(256, 7168, torch.bfloat16, marks=pytest.mark.gpu, id="256x7168-bf16"),
    pytest.param(33, 1536, torch.bfloat16, marks=pytest.mark.gpu, id="33x1536-bf16"),
    pytest.param(129, 512, torch.float16, marks=pytest.mark.gpu, id="129x512-f16"),
]


def _check_out(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all()
    tol = 2 * ULP[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("residual_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("rows,dim,dtype", CASES)
def test_rmsnorm_matches_ref(rows: int, dim: int, dtype: torch.dtype, residual_kind: str) -> None:
    torch.manual_seed(rows * dim)
    # x is a strided view (rows of a wider buffer), as a slice of a projection output would be
    x = (torch.randn(rows, dim + 24, device=DEVICE) * 3).to(dtype)[:, :dim]
    weight = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    residual_dtype = {"none": None, "same": dtype, "fp32": torch.float32}[residual_kind]
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(rows, dim, device=DEVICE).to(residual_dtype)
    expected = ref.rmsnorm(x, weight, 1e-6, residual)
    with poisoned_empty():
        got = tri.rmsnorm(x, weight, 1e-6, residual)
    if residual is None:
        _check_out(got, expected)
    else:
        _check_out(got[0], expected[0])
        assert got[1].dtype == residual.dtype
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("quant", [True, "both"])
@pytest.mark.parametrize("residual_kind", ["none", "fp32"])
@pytest.mark.parametrize("rows,dim,dtype", CASES)
def test_rmsnorm_quantized_matches_ref(
    rows: int, dim: int, dtype: torch.dtype, residual_kind: str, quant: bool | str
) -> None:
    """The output quantized for an fp8 projection (as the model's attention and dense FFN norms run in fp8
    checkpoints): the reference's quantization of its own output, within the rounding of that output.
    With quant="both" (an MoE layer's norm with fp8 experts), the output as well, and the scales row-major
    (fused_moe reads them faster so); with quant=True column-major (the fp8 GEMM's layout)."""
    torch.manual_seed(rows + dim)
    x = (torch.randn(rows, dim + 24, device=DEVICE) * 3).to(dtype)[:, :dim]
    weight = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    residual = torch.randn(rows, dim, device=DEVICE) if residual_kind == "fp32" else None
    value = ref.rmsnorm(x, weight, 1e-6, residual)
    want = ref.rmsnorm(x, weight, 1e-6, residual, quant=quant)
    with poisoned_empty():
        got = tri.rmsnorm(x, weight, 1e-6, residual, quant=quant)
    if residual is not None:
        assert torch.equal(got[1], want[1])
        value, want, got = value[0], want[0], got[0]
    if quant == "both":
        assert torch.equal(want[0], value)
        _check_out(got[0], value)
        want, got = want[1], got[1]
    scale_strides = (got[1].shape[1], 1) if quant == "both" else (1, rows)
    assert got[1].stride() == scale_strides or rows == 1
    assert_quantized_close(got, want, value, 2 * ULP[dtype])


def test_rmsnorm_leading_dims_and_fp32_weight() -> None:
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(64, device=DEVICE)  # fp32 weight with fp16 activations
    with poisoned_empty():
        got = tri.rmsnorm(x, weight, 1e-5)
    _check_out(got, ref.rmsnorm(x, weight, 1e-5))


def test_rmsnorm_rejects_bad_inputs() -> None:
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        tri.rmsnorm(x, torch.ones(31, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        tri.rmsnorm(x, torch.ones(32, device=DEVICE), 1e-6, torch.randn(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="float"):
        tri.rmsnorm(x.int(), torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="quant needs x"):
        tri.rmsnorm(x[None], torch.ones(32, device=DEVICE), 1e-6, quant=True)
    with pytest.raises(ValueError, match="quant must be"):
        tri.rmsnorm(x, torch.ones(32, device=DEVICE), 1e-6, quant="fp8")
