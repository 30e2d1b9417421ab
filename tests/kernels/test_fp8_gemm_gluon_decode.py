"""The Gluon decode fp8 GEMM for Hopper (kernels/fp8_gemm/gluon_decode_sm90.py).

`plan` (how the work is cut over the CTAs) is checked on CPU. The kernel runs on a GPU only
(Gluon has no CPU interpreter; skipped where Gluon or an sm_90 GPU is missing), against the torch
reference at shapes with ragged M, N and K (K a multiple of 16 for TMA, not of 128), both with one
whole n-tile a CTA and stream-K (n-tiles cut into pieces whose partial sums the last CTA adds).
"""

from __future__ import annotations

import pytest
import torch
from _poison import rel_err
from test_fp8_gemm import TOL, _act, _weight

from pdserve.kernels import tuning
from pdserve.kernels.fp8_gemm import _splitk, gluon_decode_sm90, ref
from pdserve.kernels.fp8_gemm import triton as tri
from pdserve.kernels.fp8_quant_triton import quantize_rows

CFG = {"BLOCK_N": 64, "num_stages": 12, "whole_tiles_fill": 0.8, "min_k": 2048, "min_m": 2}
# the tuned entries: a ring cut to the run (`ring_slots`), 128-row tiles (kv_b), tiles of three
# 64-row boxes (q_b); stores from the MMA's registers at M <= 16
TUNED = tuning._GLUON_DECODE
WIDE = tuning._GLUON_DECODE_WIDE
BOXES = tuning._GLUON_DECODE_192
gpu = pytest.mark.gpu


@pytest.mark.parametrize(
    ("n", "k", "sms"),
    [(7168, 16384, 132), (2112, 7168, 132), (36864, 7168, 132), (200, 7168, 132), (1000, 4000, 78),
     (64, 128, 132), (7168, 2048, 114), (24576, 1536, 132)],
)  # fmt: skip
def test_plan_covers_every_iteration_once(n: int, k: int, sms: int) -> None:
    """The CTAs' runs [c * W, (c + 1) * W) cover every (n-tile, k-tile) iteration once, none is
    empty, there are at most `sms` of them, and no n-tile meets more CTAs than the pieces the
    launch makes room for; whole n-tiles, the same number a CTA, where the CTAs they make hold 80%
    of what that many a CTA could (q_b: 384 n-tiles, 3 a CTA on 128 of 132 SMs)."""
    w, ctas, max_pieces = gluon_decode_sm90.plan(n, k, CFG, sms, 128)
    kt, tiles = -(-k // 128), -(-n // 64)
    total = tiles * kt
    assert ctas <= sms and (ctas - 1) * w < total <= ctas * w
    met = [set() for _ in range(tiles)]
    for c in range(ctas):
        for g in range(c * w, min((c + 1) * w, total)):
            met[g // kt].add(c)
    assert max(len(s) for s in met) <= max_pieces
    per = -(-tiles // sms)
    if tiles >= 0.8 * sms * per:
        assert (w, ctas, max_pieces) == (kt * per, -(-tiles // per), 1)
    if (n, k) == (24576, 1536):
        assert (w, ctas, max_pieces) == (36, 128, 1)


def test_plan_wide_tiles_and_ring_slots() -> None:
    """q_b with 128-row tiles: two whole n-tiles a CTA on 96 CTAs, a ring of 6 slots; with tiles of
    3 boxes of 64 rows: one a CTA on 128 CTAs, 6 slots; kv_b with 128-row tiles: two a CTA on 128.
    The ring is cut to a quarter of the run, never below min_stages nor above num_stages."""
    w, ctas, pieces = gluon_decode_sm90.plan(24576, 1536, WIDE, 132, 128)
    assert (w, ctas, pieces) == (24, 96, 1)
    assert gluon_decode_sm90.ring_slots(w, WIDE) == 6
    w, ctas, pieces = gluon_decode_sm90.plan(24576, 1536, BOXES, 132, 128)
    assert (w, ctas, pieces) == (12, 128, 1)
    assert gluon_decode_sm90.ring_slots(w, BOXES) == 6
    assert gluon_decode_sm90.plan(32768, 512, WIDE, 132, 128) == (8, 128, 1)
    assert [gluon_decode_sm90.ring_slots(w, TUNED) for w in (14, 16, 28, 36, 128)] == [
        4,
        4,
        7,
        9,
        12,
    ]
    assert gluon_decode_sm90.ring_slots(3, CFG) == 12  # no run_per_slot: num_stages


@pytest.fixture
def _hopper() -> None:
    if not torch.cuda.is_available() or not gluon_decode_sm90.available(torch.device("cuda", 0)):
        pytest.skip("needs Triton's Gluon and an sm_90 GPU")


def _inputs(m: int, n: int, k: int):
    x = _act(m, k, torch.bfloat16, seed=m + k)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    x_fp8, x_scales = quantize_rows(x, 128, scale_column_major=True)
    return x_fp8, x_scales, w_fp8, scale_inv


def _launch(x_fp8, x_scales, w_fp8, scale_inv, cfg=CFG) -> torch.Tensor:
    out = torch.full((x_fp8.shape[0], w_fp8.shape[0]), float("nan"), device="cuda")
    out = out.to(torch.bfloat16)
    assert gluon_decode_sm90.launch(x_fp8, x_scales, w_fp8, scale_inv, out, cfg, 128)
    return out


@gpu
@pytest.mark.usefixtures("_hopper")
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(64, 7168, 2048), (1, 7168, 2048), (33, 2112, 7168), (5, 1000, 4000), (64, 200, 7168),
     (17, 4096, 2048 + 16), (48, 36864, 2048), (16, 7168, 2048), (63, 2112, 7168)],
)  # fmt: skip
def test_decode_kernel_matches_reference(m: int, n: int, k: int) -> None:
    """Against the reference, and the same bits on a second run (the pieces are added in piece
    order whichever CTA finishes last); the tile counters are left at zero."""
    x_fp8, x_scales, w_fp8, scale_inv = _inputs(m, n, k)
    out = _launch(x_fp8, x_scales, w_fp8, scale_inv)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv)) < TOL[torch.bfloat16]
    assert torch.equal(out, _launch(x_fp8, x_scales, w_fp8, scale_inv))
    assert not _splitk.counters(out.device, 1).any()


@gpu
@pytest.mark.usefixtures("_hopper")
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [(5, 3000, 1536, WIDE), (64, 24576, 1536, WIDE), (20, 1000, 512 + 16, WIDE),
     (33, 2112, 7168, TUNED), (64, 7168, 2048, TUNED), (3, 200, 7168, TUNED),
     (64, 24576, 1536, BOXES), (16, 24576, 1536, BOXES), (3, 1536, 1536 + 16, {**BOXES, "whole_tiles_fill": 0.0}),
     (40, 2 * 128 * 3, 4096, {**BOXES, "boxes": 2, "whole_tiles_fill": 0.0}),
     (16, 7168, 2048, TUNED), (9, 4096, 7168, {**TUNED, "direct_max_m": 0})],
)  # fmt: skip
def test_tuned_configs_match_reference(m: int, n: int, k: int, cfg: dict) -> None:
    """The tuned entries' configs (128-row tiles, tiles of 2 or 3 boxes, shorter rings, stores from
    the MMA's registers at M <= 16 or not, PDL where the GPU has it): the reference's values, the
    same bits twice."""
    x_fp8, x_scales, w_fp8, scale_inv = _inputs(m, n, k)
    out = _launch(x_fp8, x_scales, w_fp8, scale_inv, cfg)
    assert rel_err(out, ref.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv)) < TOL[torch.bfloat16]
    assert torch.equal(out, _launch(x_fp8, x_scales, w_fp8, scale_inv, cfg))
    assert not _splitk.counters(out.device, 1).any()


@gpu
@pytest.mark.usefixtures("_hopper")
def test_decode_kernel_in_a_cuda_graph() -> None:
    """Captured once the counters exist, and replayed: the eager call's bits."""
    x_fp8, x_scales, w_fp8, scale_inv = _inputs(40, 2112, 7168)
    want = _launch(x_fp8, x_scales, w_fp8, scale_inv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _launch(x_fp8, x_scales, w_fp8, scale_inv)
    got.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@gpu
@pytest.mark.usefixtures("_hopper")
@pytest.mark.parametrize(("m", "quantized"), [(64, True), (24, True), (10, False)])
def test_decode_sizes_dispatch_to_gluon_on_hopper(monkeypatch, m: int, quantized: bool) -> None:
    """The sm_90 entries for M <= 64 run the Gluon decode kernel at K >= 2048 (a pass-through spy
    counts it), fp8_gemm quantizing its float input first; K < 2048 keeps the tl.dot kernel."""
    calls = []
    real = gluon_decode_sm90.launch

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_decode_sm90, "launch", spy)
    for k, runs in ((2048, True), (1536, False)):
        calls.clear()
        x_fp8, x_scales, w_fp8, scale_inv = _inputs(m, 1024, k)
        x = ref.dequantize_act(x_fp8, x_scales).to(torch.bfloat16)
        if quantized:
            out = tri.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv)
            want = ref.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv)
        else:
            out, want = tri.fp8_gemm(x, w_fp8, scale_inv), ref.fp8_gemm(x, w_fp8, scale_inv)
        assert calls == ([torch.Size([m, k])] if runs else [])
        assert rel_err(out, want) < TOL[torch.bfloat16]


@gpu
@pytest.mark.usefixtures("_hopper")
def test_per_shape_decode_entries_name_the_kernel() -> None:
    """DeepSeek-V3's o / mlp_w2 / qkv_a / shared_w2 entries at M = 64 take the Gluon decode kernel,
    q_b's at M = 2-64 with tiles of 3 boxes of 64 rows and kv_b's at M = 17-64 with 128-row tiles;
    mlp_w13's at M <= 16 does not, nor o's at M = 1 (through the gemv entry's "otherwise")."""
    dev = torch.device("cuda", 0)
    for n, k in ((7168, 16384), (7168, 18432), (2112, 7168), (7168, 2048)):
        assert tri._gluon_decode(tri._gemm_config(64, n, k, dev), 64, k, dev) is not None
    for m in (2, 16, 32, 64):
        gd = tri._gluon_decode(tri._gemm_config(m, 24576, 1536, dev), m, 1536, dev)
        assert (gd["BLOCK_N"], gd["boxes"]) == (64, 3)
    for m in (32, 64):
        assert (
            tri._gluon_decode(tri._gemm_config(m, 32768, 512, dev), m, 512, dev)["BLOCK_N"] == 128
        )
    assert tri._gluon_decode(tri._gemm_config(16, 32768, 512, dev), 16, 512, dev) is None
    assert tri._gluon_decode(tri._gemm_config(1, 7168, 16384, dev), 1, 16384, dev) is None
    assert tri._gluon_decode(tri._gemm_config(16, 36864, 7168, dev), 16, 7168, dev) is None
    assert tuning.find("fp8_gemm", "m<=16,n=36864,k=7168", dev) is not None


@gpu
@pytest.mark.usefixtures("_hopper")
def test_bad_input_is_refused() -> None:
    x_fp8, x_scales, w_fp8, scale_inv = _inputs(65, 256, 2048)
    out = torch.empty(65, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 64"):
        gluon_decode_sm90.launch(x_fp8, x_scales, w_fp8, scale_inv, out, CFG, 128)
    with pytest.raises(ValueError, match="BLOCK_N"):
        gluon_decode_sm90.launch(
            x_fp8[:64], x_scales[:64], w_fp8, scale_inv, out[:64], {**CFG, "BLOCK_N": 256}, 128
        )
    for boxes, n in ((4, 1024), (3, 1024)):  # 1024 rows are not whole tiles of 192
        x_fp8, x_scales, w_fp8, scale_inv = _inputs(8, n, 2048)
        out = torch.empty(8, n, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="boxes"):
            gluon_decode_sm90.launch(
                x_fp8, x_scales, w_fp8, scale_inv, out, {**BOXES, "boxes": boxes}, 128
            )
