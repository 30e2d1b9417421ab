"""The Gluon fp8 MoE GEMMs for Hopper (kernels/fused_moe/gluon_sm90.py) against the torch reference.

GPU only (Gluon has no CPU interpreter); skipped where Gluon or an sm_90 GPU is missing. Routing
as in test_fused_moe (Zipf and balanced, experts with no tokens, foreign ids); D not a multiple of
128 (TMA's zero fill past K, an odd count of k-tiles), I of one to sixteen quant groups.
"""

from __future__ import annotations

import pytest
import torch
from _poison import poisoned_empty, rel_err
from test_fused_moe import FP8_TOL, _quantized, _routing, _weights

from pdserve.kernels import tuning
from pdserve.kernels.fused_moe import gluon_sm90, ref
from pdserve.kernels.fused_moe import triton as tri

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if not torch.cuda.is_available() or not gluon_sm90.available(torch.device("cuda", 0)):
        pytest.skip("needs Triton's Gluon and an sm_90 GPU")


def _prefill_cfg() -> dict:
    return tuning.lookup("fused_moe", "fp8,rows>256", torch.device("cuda", 0))


def _case(t: int, d: int, i: int, e: int, k: int, skew: str):
    weights, ids = _routing(t, e, k, skew, seed=t + d)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(i)).to("cuda", torch.bfloat16)
    w13, w2 = _weights(e, d, i, torch.float32, seed=e)
    (w13_q, w13_s), (w2_q, w2_s) = _quantized(w13), _quantized(w2)
    return x, w13_q, w2_q, weights, ids, w13_s, w2_s


@pytest.mark.parametrize(
    ("t", "d", "i", "e", "k", "skew", "cfg_extra"),
    [
        (777, 7168, 2048, 32, 8, "zipf", {}),
        (300, 1008, 384, 8, 4, "balanced", {}),
        (129, 2064, 128, 5, 3, "zipf", {"BLOCK_N2": 64, "gluon_stages": (3, 3)}),
        (1000, 384, 256, 16, 6, "zipf", {"gluon_stages": (5, 6)}),
    ],
)
def test_gluon_moe_matches_reference(t, d, i, e, k, skew, cfg_extra) -> None:
    args = _case(t, d, i, e, k, skew)
    cfg = {**_prefill_cfg(), **cfg_extra}
    assert gluon_sm90.usable(args[0], args[1], args[2], cfg)
    with poisoned_empty():
        out = torch.empty_like(args[0])
        tri._fused_moe(*args, cfg, out)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.fused_moe(*args)) < FP8_TOL


def test_gluon_agrees_with_the_tl_dot_kernels() -> None:
    """Same quantization, same products: only the order of fp32 sums differs."""
    args = _case(512, 7168, 2048, 32, 8, "balanced")
    cfg = _prefill_cfg()
    outs = []
    for gluon in (True, False):
        out = torch.empty_like(args[0])
        outs.append(tri._fused_moe(*args, {**cfg, "gluon": gluon}, out))
    assert rel_err(outs[0], outs[1]) < 1e-2


def test_prompt_sized_call_dispatches_to_gluon(monkeypatch) -> None:
    """fused_moe on a prompt (> 256 rows per expert) takes the Gluon kernels (pass-through spies);
    an I that is not a multiple of 128 falls back to the tl.dot kernels."""
    calls = []
    for name in ("gate_up", "down"):
        real = getattr(gluon_sm90, name)
        monkeypatch.setattr(
            gluon_sm90, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    args = _case(1024, 512, 256, 4, 2, "balanced")
    out = tri.fused_moe(*args)
    assert calls == ["gate_up", "down"]
    assert rel_err(out, ref.fused_moe(*args)) < FP8_TOL
    calls.clear()
    args = _case(1024, 512, 192, 4, 2, "balanced")
    out = tri.fused_moe(*args)
    assert calls == []
    assert rel_err(out, ref.fused_moe(*args)) < FP8_TOL
