"""Programmatic dependent launch (`kernels/_backend.pdl_enabled`).

With PDL the decode GEMMs (gemv, Gluon decode kernel) start while the kernel before them is still
running and load their first weight tiles before they wait for it. A wait in the wrong place would
read the activation before its producer wrote it. The check: an MLP-shaped chain of real producers
and GEMMs (rmsnorm + quant -> GEMM -> silu_mul + quant -> GEMM -> rmsnorm + quant -> GEMM), captured
once in a CUDA graph with PDL on and replayed on fresh inputs, gives the bits of the same chain run
eagerly with PDL off. A GEMM that read a stale activation would give the previous replay's values.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_gemm import _act, _weight

from pdserve.kernels import _backend
from pdserve.kernels.fp8_gemm import triton as tri
from pdserve.kernels.rmsnorm.triton import rmsnorm
from pdserve.kernels.silu_mul.triton import silu_mul


def test_pdl_is_off_on_cpu_and_when_asked(monkeypatch) -> None:
    assert not _backend.pdl_enabled(torch.device("cpu"))
    if torch.cuda.is_available():
        monkeypatch.setenv(_backend.PDL_ENV, "0")
        assert not _backend.pdl_enabled(torch.device("cuda", 0))


def _chain(x, norm_w, w13, w2, w_out):
    """The MLP-shaped chain: every GEMM's activation comes from the kernel just before it."""
    q, s = rmsnorm(x, norm_w, 1e-6, quant=True)
    h = tri.scaled_gemm(q, s, *w13)
    inter = h.shape[1] // 2
    q, s = silu_mul(h[:, :inter], h[:, inter:], quant=True)
    y = tri.scaled_gemm(q, s, *w2)
    q, s = rmsnorm(y, norm_w, 1e-6, quant=True)
    return tri.scaled_gemm(q, s, *w_out)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 40])
def test_chain_in_a_pdl_graph_gives_the_eager_bits(monkeypatch, m: int) -> None:
    """M = 1 runs the gemv, M = 40 the Gluon decode kernel on Hopper (K >= 2048)."""
    dev = torch.device("cuda", 0)
    if not _backend.pdl_enabled(dev):
        pytest.skip("needs a GPU with programmatic dependent launch (sm_90 or later)")
    hidden, inter = 2048, 2048
    norm_w = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    w13, w2 = _weight(2 * inter, hidden, seed=1), _weight(hidden, inter, seed=2)
    w_out = _weight(7168, hidden, seed=3)  # at M = 40: whole n-tiles; the others stream-K
    inputs = [_act(m, hidden, torch.bfloat16, seed=10 + i) / 1e3 for i in range(4)]

    monkeypatch.setenv(_backend.PDL_ENV, "0")
    want = [_chain(x, norm_w, w13, w2, w_out) for x in inputs]
    monkeypatch.setenv(_backend.PDL_ENV, "1")
    static_x = inputs[0].clone()
    _chain(static_x, norm_w, w13, w2, w_out)  # compiles, and makes the tile counters, uncaptured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(static_x, norm_w, w13, w2, w_out)
    for x, expected in zip(inputs, want, strict=True):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(expected).all()
        assert torch.equal(got, expected)
