"""The batch-invariant matmul (kernels/matmul/triton.py) against torch, and its invariance: a row's result
is bit-for-bit the same in any batch (any M, any neighbours).

Tolerances: fp32 products (IEEE on both sides) within 1e-5 relative to the row's scale; fp16 / bf16
within 2 units in the last place of the output's dtype at that scale (the two sides round the fp32
sum once, after summing in different orders). CPU cases run in the interpreter in fp32 / fp16; bf16 and
DeepSeek-V3 widths run on a GPU."""

from __future__ import annotations

import pytest
import torch
from _decode_check import DEVICE, assert_quantized_close, assert_rows_match, poisoned_empty

from pdserve.kernels import forward_phase, use_batch_invariant
from pdserve.kernels.matmul import ref
from pdserve.kernels.matmul import triton as tri

ULP = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}

LINEAR_CASES = [
    pytest.param(1, 100, 70, torch.float32, id="1x100x70-f32"),
    pytest.param(37, 96, 33, torch.float16, id="37x96x33-f16"),
    pytest.param(130, 257, 64, torch.float32, id="130x257x64-f32"),
    pytest.param(64, 7168, 2112, torch.bfloat16, marks=pytest.mark.gpu, id="64x7168x2112-bf16"),
    pytest.param(3, 2048, 102400, torch.bfloat16, marks=pytest.mark.gpu, id="3x2048x102400-bf16"),
    pytest.param(4099, 2048, 576, torch.bfloat16, marks=pytest.mark.gpu, id="4099x2048x576-bf16"),
    pytest.param(77, 7168, 256, torch.float32, marks=pytest.mark.gpu, id="77x7168x256-f32"),
]


def _close(got: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    scale = expected.float().abs().amax().clamp_min(1.0)
    err = (got.float() - expected.float()).abs().amax() / scale
    assert err <= ULP[got.dtype] * 4, f"max error {err:.3g} of the scale (K={k})"


@pytest.fixture(params=["decode", "prefill"])
def phase(request):
    """The forward phase whose fixed config the kernel takes (as inside the model's forward)."""
    with use_batch_invariant(), forward_phase(request.param):
        yield request.param


@pytest.mark.parametrize("m,k,n,dtype", LINEAR_CASES)
def test_linear_matches_torch_and_is_row_invariant(m, k, n, dtype, phase) -> None:
    torch.manual_seed(m + k + n)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    with poisoned_empty():
        got = tri.linear(x, w)
    _close(got, ref.linear(x.float(), w.float()).to(dtype), k)
    for rows in (slice(0, 1), slice(m // 3, m), slice(m - 1, m)):
        assert_rows_match(tri.linear(x[rows], w), got[rows])
    # the same rows in a bigger batch, behind other rows
    padded = torch.cat([torch.randn(5, k, device=DEVICE).to(dtype), x])
    assert_rows_match(tri.linear(padded, w)[5:], got)


ROUTER_CASES = [
    pytest.param(1, 96, 40, torch.float16, id="1x96x40-f16"),
    pytest.param(19, 200, 24, torch.float16, id="19x200x24-f16"),
    pytest.param(64, 7168, 256, torch.bfloat16, marks=pytest.mark.gpu, id="64x7168x256-bf16"),
    pytest.param(513, 7168, 256, torch.bfloat16, marks=pytest.mark.gpu, id="513x7168x256-bf16"),
    pytest.param(3, 2048, 64, torch.bfloat16, marks=pytest.mark.gpu, id="3x2048x64-bf16"),
]


@pytest.mark.parametrize("m,k,n,dtype", ROUTER_CASES)
def test_linear_with_fp32_output(m, k, n, dtype, phase) -> None:
    """out_dtype=float32 (the MoE router's logits) from 16-bit operands: the exact products' sum in fp32, as
    upcasting both operands gives, within 1e-5 of the row's scale; both implementations (the torch one runs
    cuBLAS's GEMM with an fp32 output on a GPU). The Triton kernel keeps its row invariance."""
    torch.manual_seed(m + 2 * k + n)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    want = ref.linear(x.double(), w.double()).float()
    for impl in (ref, tri):
        with poisoned_empty():
            got = impl.linear(x[None], w, out_dtype=torch.float32)[0]
        assert got.dtype == torch.float32 and got.shape == (m, n)
        _close(got, want, k)
    assert_rows_match(tri.linear(x[m // 2 :], w, out_dtype=torch.float32), got[m // 2 :])  # tri's


def test_linear_out_dtype_refused() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    for impl in (tri, ref):
        assert (
            impl.linear(x, x[:2], out_dtype=torch.float32).dtype == torch.float32
        )  # x's own dtype
        with pytest.raises(ValueError, match="out_dtype torch.float16 needs float32"):
            impl.linear(x, x[:2], out_dtype=torch.float16)
        with pytest.raises(ValueError, match="x torch.float16.*w torch.float32"):
            impl.linear(x.half(), x[:2], out_dtype=torch.float32)


HEAD_CASES = [
    pytest.param(9, 3, 40, 24, False, torch.float32, id="9x3x40x24-f32"),
    pytest.param(5, 4, 32, 48, True, torch.float16, id="5x4x32x48-t-f16"),
    pytest.param(1, 2, 64, 16, True, torch.float32, id="1x2x64x16-t-f32"),
    pytest.param(
        64, 16, 128, 512, False, torch.bfloat16, marks=pytest.mark.gpu, id="q-absorb-bf16"
    ),
    pytest.param(33, 16, 512, 128, True, torch.bfloat16, marks=pytest.mark.gpu, id="v-absorb-bf16"),
]


@pytest.mark.parametrize("t,h,k,n,transposed,dtype", HEAD_CASES)
def test_head_matmul_matches_torch(t, h, k, n, transposed, dtype, phase) -> None:
    torch.manual_seed(t * h + k)
    x = torch.randn(t, h, k, device=DEVICE).to(dtype)
    w = (torch.randn(h, n, k, device=DEVICE) / k**0.5).to(dtype)
    w = w.transpose(1, 2) if transposed else w.reshape(h, k, n)  # a strided view, or contiguous
    with poisoned_empty():
        got = tri.head_matmul(x, w)
    _close(got, ref.head_matmul(x.float(), w.float()).to(dtype), k)
    assert_rows_match(tri.head_matmul(x[t // 2 :], w), got[t // 2 :])


@pytest.mark.parametrize("t,h,k,n,transposed,dtype", HEAD_CASES)
def test_head_matmul_into_a_wider_buffer(t, h, k, n, transposed, dtype, phase) -> None:
    """out=: the product lands in the first N columns of a [T, H, N + 7] buffer, as the absorbed query is
    built beside its rope part; the columns after it keep their values. Both implementations; Triton's
    gives the bits it gives without out."""
    torch.manual_seed(t + 3 * h + k)
    x = torch.randn(t, h, k, device=DEVICE).to(dtype)
    w = (torch.randn(h, n, k, device=DEVICE) / k**0.5).to(dtype)
    w = w.transpose(1, 2) if transposed else w.reshape(h, k, n)
    want = ref.head_matmul(x.float(), w.float()).to(dtype)
    for impl in (tri, ref):
        buf = torch.randn(t, h, n + 7, device=DEVICE).to(dtype)
        tail = buf[..., n:].clone()
        with poisoned_empty():
            got = impl.head_matmul(x, w, out=buf[..., :n])
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(buf[..., n:], tail)
        _close(buf[..., :n], want, k)
        if impl is tri:  # the Triton kernel takes out's strides: the same bits as without out
            assert torch.equal(buf[..., :n], tri.head_matmul(x, w))


QUANT_CASES = [
    pytest.param(9, 3, 40, 128, False, torch.float32, id="9x3x40x128-f32"),
    pytest.param(5, 2, 96, 256, True, torch.float16, id="5x2x96x256-t-f16"),
    pytest.param(1, 4, 64, 128, True, torch.float32, id="1x4x64x128-t-f32"),
    pytest.param(
        64, 128, 512, 128, True, torch.bfloat16, marks=pytest.mark.gpu, id="v-absorb-64-bf16"
    ),
    pytest.param(
        1, 128, 512, 128, True, torch.bfloat16, marks=pytest.mark.gpu, id="v-absorb-1-bf16"
    ),
    pytest.param(
        100, 16, 512, 128, True, torch.bfloat16, marks=pytest.mark.gpu, id="v-absorb-tp8-bf16"
    ),
]


@pytest.mark.parametrize("t,h,k,n,transposed,dtype", QUANT_CASES)
def test_head_matmul_quantized_matches_torch(t, h, k, n, transposed, dtype) -> None:
    """Quantized for the fp8 o projection (W_UV's product in the absorbed decode): the reference's
    quantize_act of the product as [T, H * N], within the rounding of the product itself (summed in
    another order, a bf16 product differs by an ulp in places, and a few of those cross an e4m3 rounding
    boundary: up to 5% of the codes). The product takes no split of K, so a row's codes are the same
    in any batch."""
    torch.manual_seed(t + h + k)
    x = torch.randn(t, h, k, device=DEVICE).to(dtype)
    w = (torch.randn(h, n, k, device=DEVICE) / k**0.5).to(dtype)
    w = w.transpose(1, 2) if transposed else w.reshape(h, k, n)
    value = ref.head_matmul(x.float(), w.float()).to(dtype).reshape(t, h * n)
    with poisoned_empty():
        got = tri.head_matmul(x, w, quant=True)
    want = ref.head_matmul(x, w, quant=True)
    assert_quantized_close(got, want, value, 4 * ULP[dtype], max_code_mismatch=0.05)
    part_q, part_s = tri.head_matmul(x[t // 2 :], w, quant=True)
    assert torch.equal(part_q.view(torch.uint8), got[0][t // 2 :].view(torch.uint8))
    assert torch.equal(part_s, got[1][t // 2 :])


def test_bad_inputs_are_named() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        tri.linear(x, torch.randn(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="one float dtype"):
        tri.linear(x, torch.randn(4, 8, device=DEVICE).half())
    assert tri.linear(x[:0], torch.randn(4, 8, device=DEVICE)).shape == (0, 4)
    heads = torch.randn(2, 3, 8, device=DEVICE)
    w = torch.randn(3, 8, 64, device=DEVICE)
    for impl in (tri, ref):
        with pytest.raises(ValueError, match="multiple of 128"):
            impl.head_matmul(heads, w, quant=True)
        with pytest.raises(ValueError, match="must be \\(2, 3, 64\\)"):
            impl.head_matmul(heads, w, out=torch.empty(2, 3, 65, device=DEVICE))
        with pytest.raises(ValueError, match="must be"):
            impl.head_matmul(heads, w, out=torch.empty(2, 3, 64, device=DEVICE).half())
        with pytest.raises(ValueError, match="last stride"):
            impl.head_matmul(heads, w, out=torch.empty(2, 3, 64, 2, device=DEVICE)[..., 0])
        with pytest.raises(ValueError, match="unquantized"):
            impl.head_matmul(heads, torch.randn(3, 8, 128, device=DEVICE), quant=True,
                             out=torch.empty(2, 3, 128, device=DEVICE))  # fmt: skip
