"""The Gluon fp8 GEMM for Hopper (kernels/fp8_gemm/gluon_sm90.py) against the torch reference.

GPU only (Gluon has no CPU interpreter); skipped where Gluon or an sm_90 GPU is missing. Shapes
with ragged M, N and K (K a multiple of 16 for TMA, not of 128), an odd count of k-tiles (padded
to whole groups with TMA's zero fill) and several tiles along both M and N.
"""

from __future__ import annotations

import pytest
import torch
from _poison import rel_err
from test_fp8_gemm import TOL, _act, _weight

from pdserve.kernels.fp8_gemm import gluon_sm90, ref
from pdserve.kernels.fp8_gemm import triton as tri
from pdserve.kernels.fp8_quant_triton import quantize_rows

pytestmark = pytest.mark.gpu

CFG = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if not torch.cuda.is_available() or not gluon_sm90.available(torch.device("cuda", 0)):
        pytest.skip("needs Triton's Gluon and an sm_90 GPU")


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "cfg"),
    [
        (200, 3000, 4000, torch.bfloat16, CFG),
        (300, 384, 7168, torch.bfloat16, {**CFG, "GROUP_M": 16}),
        (257, 7168, 640, torch.bfloat16, {**CFG, "num_stages": 3}),
        (129, 200, 384, torch.float32, CFG),
        (64, 1000, 1100 - 1100 % 16, torch.bfloat16, {**CFG, "num_stages": 6}),
        (1000, 576, 1536, torch.bfloat16, {**CFG, "BLOCK_N": 64}),
    ],
)
def test_gluon_gemm_matches_reference(
    m: int, n: int, k: int, dtype: torch.dtype, cfg: dict
) -> None:
    x = _act(m, k, dtype, seed=m + k)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    x_fp8, x_scales = quantize_rows(x, 128, scale_column_major=True)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    gluon_sm90.launch(x_fp8, x_scales, w_fp8, scale_inv, out, cfg, ref.WEIGHT_QUANT_BLOCK)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[dtype]


def test_large_m_dispatches_to_gluon_on_hopper(monkeypatch) -> None:
    """The tuned sm_90 entry for M > 128 runs the Gluon kernel (a pass-through spy counts it)."""
    calls = []
    real = gluon_sm90.launch

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_sm90, "launch", spy)
    x = _act(512, 1024, torch.bfloat16, seed=1)
    w_fp8, scale_inv = _weight(768, 1024, seed=2)
    out = tri.fp8_gemm(x, w_fp8, scale_inv)
    assert calls == [torch.Size([512, 1024])]
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[torch.bfloat16]


def test_bad_config_is_refused() -> None:
    x_fp8 = torch.zeros(128, 256, device="cuda").to(torch.float8_e4m3fn)
    scales = torch.ones(128, 2, device="cuda")
    w_fp8 = torch.zeros(256, 256, device="cuda").to(torch.float8_e4m3fn)
    w_s = torch.ones(2, 2, device="cuda")
    out = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_N must divide"):
        gluon_sm90.launch(x_fp8, scales, w_fp8, w_s, out, {**CFG, "BLOCK_N": 256}, 128)
    with pytest.raises(ValueError, match="BLOCK_M must be 128"):
        gluon_sm90.launch(x_fp8, scales, w_fp8, w_s, out, {**CFG, "BLOCK_M": 64}, 128)
