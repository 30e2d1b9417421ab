"""Triton silu_mul (SwiGLU's activation, optionally quantized for the fp8 down projection) against the
torch reference.

Tolerances: the product within 2 units in the last place of its dtype, relative (the kernel's sigmoid is
not torch's, bit for bit). Quantized: the scales within 2 ulp of fp32 relative (amax of the same
rounded values), and each dequantized value within half an e4m3 step of the reference's product plus
those 2 ulp. On CPU the kernel runs in the interpreter, so CPU cases are fp32 / fp16 (its fp32 -> bf16
cast truncates); bf16 and DeepSeek-V3 widths are GPU cases. gate and up are column slices of one
stacked product, as the model passes them."""

from __future__ import annotations

import pytest
import torch
from _decode_check import DEVICE, assert_quantized_close, poisoned_empty

from pdserve import kernels
from pdserve.kernels.silu_mul import ref
from pdserve.kernels.silu_mul import triton as tri

ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

CASES = [
    pytest.param(1, 100, torch.float32, id="1x100-f32"),
    pytest.param(7, 300, torch.float16, id="7x300-f16"),
    pytest.param(13, 256, torch.float32, id="13x256-f32"),
    pytest.param(64, 18432, torch.bfloat16, marks=pytest.mark.gpu, id="64x18432-bf16"),
    pytest.param(1, 2048, torch.bfloat16, marks=pytest.mark.gpu, id="1x2048-bf16"),
    pytest.param(300, 1408, torch.bfloat16, marks=pytest.mark.gpu, id="300x1408-bf16"),
    pytest.param(5, 200, torch.float16, marks=pytest.mark.gpu, id="5x200-f16"),
]


def _stacked(rows: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as views into one [rows, 2 * padded] product, the layout of the model's w13."""
    padded = -(-inter // 128) * 128
    both = (torch.randn(rows, 2 * padded, device=DEVICE) * 3).to(dtype)
    return both[:, :inter], both[:, padded : padded + inter]


@pytest.mark.parametrize("rows,inter,dtype", CASES)
def test_silu_mul_matches_ref(rows: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows * inter)
    gate, up = _stacked(rows, inter, dtype)
    expected = ref.silu_mul(gate, up)
    with poisoned_empty():
        got = tri.silu_mul(gate, up)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 2 * ULP[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,inter,dtype", CASES)
def test_silu_mul_quantized_matches_ref(rows: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows + inter)
    gate, up = _stacked(rows, inter, dtype)
    with poisoned_empty():
        got = tri.silu_mul(gate, up, quant=True)
    want = ref.silu_mul(gate, up, quant=True)
    assert_quantized_close(got, want, ref.silu_mul(gate, up), 2 * ULP[dtype])


def test_quantized_output_feeds_the_fp8_gemm() -> None:
    """silu_mul's fp8 output through scaled_gemm equals fp8_gemm on the bf16 product (one quantizer)."""
    torch.manual_seed(0)
    gate, up = _stacked(5, 256, torch.float32)
    w_fp8, w_scale = kernels.quantize_weight(torch.randn(96, 256, device=DEVICE) * 0.05)
    x_q, x_scales = tri.silu_mul(gate, up, quant=True)
    got = kernels.scaled_gemm(x_q, x_scales, w_fp8, w_scale, torch.float32)
    want = kernels.fp8_gemm(ref.silu_mul(gate, up), w_fp8, w_scale)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("impl", [ref, tri], ids=["ref", "triton"])
def test_bad_inputs_are_named(impl) -> None:
    gate = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="up must match gate"):
        impl.silu_mul(gate, torch.randn(4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="up must match gate"):
        impl.silu_mul(gate, gate.half())
    with pytest.raises(ValueError, match="2-D float"):
        impl.silu_mul(gate[None], gate[None])
    with pytest.raises(ValueError, match="unit stride"):
        impl.silu_mul(gate.t(), gate.t())


def test_empty_rows() -> None:
    gate = torch.randn(0, 256, device=DEVICE)
    assert tri.silu_mul(gate, gate).shape == (0, 256)
    q, scales = tri.silu_mul(gate, gate, quant=True)
    assert q.shape == (0, 256) and scales.shape == (0, 2)
