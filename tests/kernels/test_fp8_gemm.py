"""Triton fp8_gemm / quantize_act against the torch reference.

On CPU the kernels run in the Triton interpreter at tiny shapes with fp32/fp16 inputs (the
interpreter's bf16 dot is wrong); on a GPU (`gpu` marker) at DeepSeek-V3 shapes in bf16.
Tolerances (relative Frobenius error against the reference, which quantizes identically):
fp32 out 1e-5 in the interpreter (only summation order differs) and 5e-4 on a GPU (Hopper's fp8
MMA keeps about 14 bits while it sums each 128-deep k-tile); fp16 out 2e-3; bf16 out 1e-2 (output
rounding). Quantization matches the reference bit for bit on CPU; on a GPU torch divides by the
scalar 448 through a reciprocal, so its scales may differ from ours (correctly rounded) by one ulp,
and the fp8 value of an element whose group scale differs by one e4m3 step at most.
"""

from __future__ import annotations

import pytest
import torch
from _poison import poisoned_empty, rel_err

from pdserve.kernels.fp8_gemm import _splitk, ref
from pdserve.kernels.fp8_gemm import triton as tri
from pdserve.kernels.fp8_quant_triton import quantize_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 5e-4 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
gpu = pytest.mark.gpu


def _act(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random activations whose 128-groups span six decades; one all-zero group when k > 128."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    decades = torch.empty(m, -(-k // 128)).uniform_(-3, 3, generator=g)
    x *= (10.0**decades).repeat_interleave(128, dim=1)[:, :k]
    if k > 128:
        x[:, 128:256] = 0.0
    return x.to(DEVICE, dtype)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    blocks = torch.empty(-(-n // 128), -(-k // 128)).uniform_(-1, 1, generator=g)
    w *= (10.0**blocks).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    w_fp8, scale_inv = ref.quantize_weight(w)
    return w_fp8.to(DEVICE), scale_inv.to(DEVICE)


QUANT_CASES = [
    (1, 128),
    (33, 300),
    (70, 576),
    pytest.param(4096, 7168, marks=gpu),
    pytest.param(3, 16384, marks=gpu),
    pytest.param(333, 1000, marks=gpu),
]


@pytest.mark.parametrize(("m", "k"), QUANT_CASES)
def test_quantize_act_matches_reference_bitwise(m: int, k: int) -> None:
    x = _act(m, k, torch.bfloat16 if CUDA else torch.float32, seed=m + k)
    with poisoned_empty():
        q, s = tri.quantize_act(x)
    q_ref, s_ref = ref.quantize_act(x)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=2**-23, atol=0)
    same_scale = (s == s_ref).repeat_interleave(128, dim=1)[:, :k]
    if not CUDA:
        assert same_scale.all()
    q, q_ref = q.float(), q_ref.float()
    assert torch.equal(q[same_scale], q_ref[same_scale])
    one_step = (q - q_ref).abs() <= q_ref.abs() / 8 + 2**-9  # e4m3: 3 mantissa bits
    assert one_step.all()


# (M, N, K, dtype): odd M, M=1, N=576 (kv_a), N and K off multiples of 128.
GEMM_CASES = [
    (1, 200, 300, torch.float32),
    (33, 576, 256, torch.float32),
    (70, 64, 384, torch.float16),
    pytest.param(64, 576, 7168, torch.bfloat16, marks=gpu),
    pytest.param(1, 24576, 1536, torch.bfloat16, marks=gpu),
    pytest.param(4, 18432, 7168, torch.bfloat16, marks=gpu),
    pytest.param(17, 7168, 16384, torch.bfloat16, marks=gpu),
    pytest.param(129, 1000, 1100, torch.bfloat16, marks=gpu),
    pytest.param(2048, 4096, 7168, torch.bfloat16, marks=gpu),
    pytest.param(300, 1536, 7168, torch.float32, marks=gpu),
]


@pytest.mark.parametrize(("m", "n", "k", "dtype"), GEMM_CASES)
def test_fp8_gemm_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = _act(m, k, dtype, seed=m)
    w_fp8, scale_inv = _weight(n, k, seed=n + k)
    with poisoned_empty():
        out = tri.fp8_gemm(x, w_fp8, scale_inv)
    expected = ref.fp8_gemm(x, w_fp8, scale_inv)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[dtype]


_BASE = {"GROUP_M": 4, "num_warps": 4, "num_stages": 2, "min_k_tiles": 1}
PATH_CONFIGS = {
    "fused-quant-split-k": {**_BASE, "BLOCK_M": 16, "BLOCK_N": 64, "split_k_target_ctas": 64},
    "fused-quant-swap-ab-split-k": {**_BASE, "BLOCK_M": 16, "BLOCK_N": 64, "split_k_target_ctas": 64,
                                     "swap_ab": True, "one_wave": True},
    "fused-quant-n32": {**_BASE, "BLOCK_M": 32, "BLOCK_N": 32, "split_k_target_ctas": 0},
    "prequant-swap-ab-n256": {**_BASE, "BLOCK_M": 32, "BLOCK_N": 256, "split_k_target_ctas": 0,
                              "swap_ab": True},
    "prequant-n256": {**_BASE, "BLOCK_M": 32, "BLOCK_N": 256, "split_k_target_ctas": 0},
    "prequant-split-k-n32": {**_BASE, "BLOCK_M": 64, "BLOCK_N": 32, "split_k_target_ctas": 32},
    "tma": {**_BASE, "BLOCK_M": 32, "BLOCK_N": 64, "split_k_target_ctas": 0, "tma": True},
    "tma-lag": {**_BASE, "BLOCK_M": 64, "BLOCK_N": 128, "split_k_target_ctas": 0, "tma": True,
                "lag": True},
    "tma-n256": {**_BASE, "BLOCK_M": 16, "BLOCK_N": 256, "split_k_target_ctas": 0, "tma": True},
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(PATH_CONFIGS))
@pytest.mark.parametrize(
    ("m", "n", "k"), [(19, 320, 720), pytest.param(200, 3000, 4000, marks=gpu)]
)
def test_gemm_code_paths(path: str, m: int, n: int, k: int) -> None:
    """Each kernel variant (in-kernel quantization, split K, per-column weight scales, TMA).
    K is a multiple of 16 (TMA's alignment) but not of 128."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = _act(m, k, dtype, seed=k)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    cfg = PATH_CONFIGS[path]
    with poisoned_empty():
        out = torch.empty((m, n), dtype=dtype, device=DEVICE)
        if path.startswith("fused-quant"):
            tri._launch_gemm(x, None, w_fp8, scale_inv, out, cfg)
        else:
            x_fp8, x_scales = quantize_rows(x, 128, scale_column_major=True)
            tri._launch_gemm(x_fp8, x_scales, w_fp8, scale_inv, out, cfg)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[dtype]


@pytest.mark.parametrize("path", [p for p in PATH_CONFIGS if p.startswith("fused-quant")])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 72, 720), (3, 130, 400), (5, 64, 256), pytest.param(1, 7168, 16384, marks=gpu)],
)
def test_fused_quant_with_fewer_rows_than_the_tile(path: str, m: int, n: int, k: int) -> None:
    """M < BLOCK_M: the kernel quantizes the next power of two of M rows and repeats them down the
    tile; the rows past M must not reach the output."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = _act(m, k, dtype, seed=m + k)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    with poisoned_empty():
        out = torch.empty((m, n), dtype=dtype, device=DEVICE)
        tri._launch_gemm(x, None, w_fp8, scale_inv, out, PATH_CONFIGS[path])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[dtype]


GEMV_CONFIGS = {
    "split-k": {"gemv": True, "max_m": 4, "BLOCK_N": 32, "GROUPS": 2, "num_warps": 4,
                "num_stages": 1, "split_k_target_ctas": 64, "min_k_tiles": 1},
    "one-split-n8-g4": {"gemv": True, "max_m": 4, "BLOCK_N": 8, "GROUPS": 4, "num_warps": 2,
                        "num_stages": 2, "split_k_target_ctas": 0, "min_k_tiles": 1},
    "n16-g2-split-k": {"gemv": True, "max_m": 4, "BLOCK_N": 16, "GROUPS": 2, "num_warps": 4,
                       "num_stages": 1, "split_k_target_ctas": 40, "min_k_tiles": 1},
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(GEMV_CONFIGS))
@pytest.mark.parametrize("prequant", [False, True])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 72, 720), (3, 72, 1000), (4, 130, 256),
     pytest.param(1, 7168, 16384, marks=gpu), pytest.param(3, 576, 7168, marks=gpu),
     pytest.param(2, 1000, 1100, marks=gpu)],
)  # fmt: skip
def test_gemv_paths(path: str, prequant: bool, m: int, n: int, k: int) -> None:
    """The CUDA-core kernel for M <= 4: K split or whole, N and K off its tiles, M padded to 4."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = _act(m, k, dtype, seed=k + m)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    cfg = GEMV_CONFIGS[path]
    with poisoned_empty():
        out = torch.empty((m, n), dtype=dtype, device=DEVICE)
        if prequant:
            x_fp8, x_scales = quantize_rows(x, 128, scale_column_major=True)
            tri._launch_gemm(x_fp8, x_scales, w_fp8, scale_inv, out, cfg)
        else:
            tri._launch_gemm(x, None, w_fp8, scale_inv, out, cfg)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[dtype]


def _shape_entries() -> list[tuple[int, int, int]]:
    """(M, N, K) of each per-shape entry of the Hopper table ("m<=B,n=N,k=K"), M at its class's bound."""
    from pdserve.kernels import tuning

    shapes = []
    for key in tuning._TABLES["fp8_gemm"].get("sm90", {}):
        if ",n=" in key:
            cls, n, k = key.split(",")
            shapes.append((int(cls.removeprefix("m<=")), int(n[2:]), int(k[2:])))
    return shapes


@gpu
@pytest.mark.parametrize(("m", "n", "k"), _shape_entries())
def test_per_shape_entries_match_reference(m: int, n: int, k: int) -> None:
    """Each projection with its own tuned entry, at that shape, through the public entry points."""
    x = _act(m, k, torch.bfloat16, seed=n + k)
    w_fp8, scale_inv = _weight(n, k, seed=n)
    want = ref.fp8_gemm(x, w_fp8, scale_inv)
    assert rel_err(tri.fp8_gemm(x, w_fp8, scale_inv), want) < TOL[torch.bfloat16]
    x_fp8, x_scales = quantize_rows(x, 128, scale_column_major=True)
    got = tri.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv)
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "cfg", [GEMV_CONFIGS["split-k"], PATH_CONFIGS["fused-quant-swap-ab-split-k"],
            PATH_CONFIGS["prequant-split-k-n32"]], ids=["gemv", "mma-swap-ab", "mma"],
)  # fmt: skip
def test_split_k_sum_in_the_launch_matches_the_second_kernel(cfg: dict, monkeypatch) -> None:
    """With tile counters the last program of each tile adds the splits' partials; the sum (in
    split order) equals the two-kernel path's bit for bit, and the counters are zero again after
    each call."""
    # K of six 128-deep tiles, the last partial: every config splits it (3 to 6 ways)
    m, n, k = (1, 200, 720) if cfg.get("gemv") else (19, 320, 720)
    dtype = torch.bfloat16 if CUDA else torch.float32
    real_prepare, splits_taken = _splitk.prepare, []

    def prepare(out, splits, tiles):
        splits_taken.append(splits)
        return real_prepare(out, splits, tiles)

    monkeypatch.setattr(_splitk, "prepare", prepare)
    x = _act(m, k, dtype, seed=3)
    w_fp8, scale_inv = _weight(n, k, seed=4)
    if cfg is PATH_CONFIGS["prequant-split-k-n32"]:
        x, x_scales = quantize_rows(x, 128, scale_column_major=True)
    else:
        x_scales = None
    runs = []
    for fold in (True, True, False):
        if not fold:
            monkeypatch.setattr(_splitk, "counters", lambda device, tiles: None)
        with poisoned_empty():
            out = torch.empty((m, n), dtype=dtype, device=DEVICE)
            tri._launch_gemm(x, x_scales, w_fp8, scale_inv, out, cfg)
        runs.append(out)
        if fold:
            assert not _splitk._COUNTERS[out.device].any()
    assert min(splits_taken) > 1, splits_taken
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("max_work", [0, 10**9])
def test_fused_quantization_gives_way_past_its_work_bound(max_work: int, monkeypatch) -> None:
    """A fuse_quant entry quantizes x inside the GEMM while its weight-row blocks quantize at most
    fuse_max_work activation elements between them (ceil(N / BLOCK_N) * K); past it x is
    quantized once beforehand. Same result either way."""
    m, n, k = 1, 200, 720
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = _act(m, k, dtype, seed=8)
    w_fp8, scale_inv = _weight(n, k, seed=9)
    cfg = {**GEMV_CONFIGS["split-k"], "fuse_quant": True, "fuse_max_work": max_work}
    monkeypatch.setattr(tri, "_gemm_config", lambda m, n, k, device: cfg)
    calls = []
    monkeypatch.setattr(
        tri, "quantize_rows", lambda *a, **kw: calls.append(1) or quantize_rows(*a, **kw)
    )
    out = tri.fp8_gemm(x, w_fp8, scale_inv)
    assert len(calls) == (1 if max_work < 7 * k else 0)
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[dtype]


def test_gemv_entry_hands_over_past_its_bounds() -> None:
    """A gemv entry serves M = 1 up to its max_k; other shapes take the entry it names."""
    dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    gemv = tri._gemm_config(1, 256, 512, dev)
    assert gemv.get("gemv") and gemv["max_m"] == 1
    assert not tri._gemm_config(2, 256, 512, dev).get("gemv")
    if "max_k" in gemv:
        assert not tri._gemm_config(1, 256, gemv["max_k"] + 128, dev).get("gemv")


def test_scaled_gemm_on_prequantized_input() -> None:
    x = _act(45, 640, torch.float32, seed=3)
    w_fp8, scale_inv = _weight(96, 640, seed=4)
    x_fp8, x_scales = ref.quantize_act(x)
    with poisoned_empty():
        out = tri.scaled_gemm(x_fp8, x_scales, w_fp8, scale_inv, torch.float32)
    assert rel_err(out, ref.fp8_gemm(x, w_fp8, scale_inv)) < TOL[torch.float32]


def test_inputs_are_checked() -> None:
    x = _act(4, 256, torch.float32, seed=0)
    w_fp8, scale_inv = _weight(128, 256, seed=0)
    with pytest.raises(ValueError, match="x:"):
        tri.fp8_gemm(x.to(torch.int32), w_fp8, scale_inv)
    with pytest.raises(ValueError, match="K=300"):
        tri.fp8_gemm(_act(4, 300, torch.float32, seed=0), w_fp8, scale_inv)
    with pytest.raises(ValueError, match="w_fp8"):
        tri.fp8_gemm(x, w_fp8.float(), scale_inv)
    with pytest.raises(ValueError, match="w_scale_inv"):
        tri.fp8_gemm(x, w_fp8, scale_inv[:, :1])
    with pytest.raises(ValueError, match="group_size"):
        tri.quantize_act(x, group_size=100)
