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

from pdserve.kernels.mla_decode import fp8_format

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_rows_match(got: torch.Tensor, want: torch.Tensor) -> None:
    """A batch-invariant kernel's rows computed in another batch: bit-for-bit equal on a GPU. Under the CPU
    interpreter `tl.dot` is numpy's matmul, whose summation order depends on the row count on some CPUs
    (OpenBLAS's small-matrix kernels on AMD EPYC: `a[:1] @ b != (a @ b)[:1]`), so there the rows only agree
    to rounding and the bit-exact claim is checked on the GPU."""
    if got.is_cuda:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


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


E4M3_HALF_STEP = 2.0**-4
"""Half the spacing of e4m3 normals relative to the value (3 mantissa bits)."""


def assert_quantized_close(
    got, want, value: torch.Tensor, tol: float, max_code_mismatch: float = 0.01
) -> None:
    """got, want: (x_fp8, scales) of 1x128-group quantizations of `value` (the unquantized result,
    [T, D]), ours and the reference's. The scales within `tol` (+ an fp32 ulp) relative (the amax of
    values computed within `tol`); each dequantized value within half an e4m3 step of `value` plus
    `tol`; at most `max_code_mismatch` of the fp8 codes differ from the reference's (values within
    `tol` of a rounding boundary)."""
    (got_q, got_scales), (want_q, want_scales) = got, want
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == value.shape
    assert got_scales.shape == want_scales.shape == (value.shape[0], -(-value.shape[1] // 128))
    # plus an fp32 ulp for the division by 448
    torch.testing.assert_close(got_scales, want_scales, rtol=tol + 2.0**-23, atol=0)
    scale = got_scales.repeat_interleave(128, dim=-1)[:, : value.shape[1]]
    got_value = got_q.float() * scale
    value = value.float()
    bound = (E4M3_HALF_STEP + tol) * value.abs() + scale * (2.0**-9 + tol)
    assert (got_value - value).abs().le(bound).all()
    assert (got_q.float() != want_q.float()).float().mean().item() <= max_code_mismatch


def exact_fp8_rows(tokens: int, lora: int, rope: int, seed: int):
    """c_kv whose quantization is exact (fp8 values times a power-of-two scale, row max exactly 448
    times it) and bf16-valued k_pe: the interpreter's inexact fp8 / bf16 casts then never round."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7F, (tokens, lora), generator=g, dtype=torch.uint8)  # no NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    values = values * torch.where(torch.rand(tokens, lora, generator=g) < 0.5, -1.0, 1.0)
    values[:, 0] = fp8_format.FP8_E4M3_MAX
    scales = 2.0 ** torch.randint(-12, 3, (tokens, 1), generator=g).float()
    k_pe = torch.randn(tokens, rope, generator=g).to(torch.bfloat16)
    return values * scales, k_pe
