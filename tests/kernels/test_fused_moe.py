"""Triton fused_moe against the torch reference, bf16-style and fp8 w8a8 weights.

On CPU the kernels run in the Triton interpreter at tiny shapes with fp32/fp16 (the interpreter's
bf16 dot is wrong); on a GPU (`gpu` marker) at DeepSeek-V3 expert shapes in bf16. Routing covers
balanced and Zipf-skewed choices, experts with no tokens, ids of -1 and ids >= E (other ranks').
Tolerances (relative Frobenius error): fp32 1e-5 (summation order); fp16 3e-3 and bf16 2e-2 (act
and per-expert outputs are rounded to x's dtype between steps; the reference keeps fp32); fp8 adds
rare one-step differences where act quantization sits on a rounding tie: 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from _poison import poisoned_empty, rel_err

from pdserve.kernels.fp8_quant import quantize_act, quantize_weight
from pdserve.kernels.fp8_quant_triton import quantize_rows as quantize_tri
from pdserve.kernels.fused_moe import _triton_layout as tri_layout
from pdserve.kernels.fused_moe import ref
from pdserve.kernels.fused_moe import triton as tri

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
FP8_TOL = 2e-2
gpu = pytest.mark.gpu
gpu_sweep = pytest.mark.gpu_sweep


def _routing(
    num_tokens: int, num_experts: int, top_k: int, skew: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as the router picks them); expert 1 never chosen; some slots
    -1 or >= E (experts of other ranks)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skew == "zipf":  # expert e chosen with weight ~ 1 / (e + 1)
        logits += 4.0 * -torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    logits[:, 1] = -1e9
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    foreign = torch.rand(num_tokens, top_k, generator=g) < 0.1
    ids[foreign] = torch.where(torch.rand(int(foreign.sum()), generator=g) < 0.5, -1, num_experts)
    return weights.float().to(DEVICE), ids.int().to(DEVICE)


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_weight(w_e.float()) for w_e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


# (T, D, I, E, k, skew, dtype): M=1, ragged T, D and I off multiples of 128 on some cases.
CASES = [
    (1, 256, 128, 8, 4, "balanced", torch.float32),
    (37, 192, 96, 8, 3, "zipf", torch.float32),
    (29, 256, 128, 6, 2, "balanced", torch.float16),
    pytest.param(64, 7168, 2048, 32, 8, "balanced", torch.bfloat16, marks=gpu),
    pytest.param(512, 7168, 2048, 32, 8, "zipf", torch.bfloat16, marks=gpu),
    pytest.param(1000, 1024, 320, 16, 6, "zipf", torch.bfloat16, marks=gpu),
    pytest.param(2, 7168, 2048, 32, 8, "balanced", torch.bfloat16, marks=gpu),
    pytest.param(3, 576, 200, 64, 8, "balanced", torch.float16, marks=gpu),
]


@pytest.mark.parametrize(("t", "d", "i", "e", "k", "skew", "dtype"), CASES)
def test_fused_moe_matches_reference(t, d, i, e, k, skew, dtype) -> None:
    weights, ids = _routing(t, e, k, skew, seed=t + e)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(DEVICE, dtype)
    w13, w2 = _weights(e, d, i, dtype, seed=d + i)
    with poisoned_empty():
        out = tri.fused_moe(x, w13, w2, weights, ids)
    expected = ref.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[dtype]


FP8_CASES = [
    (5, 256, 128, 4, 2, "balanced"),
    (23, 384, 256, 6, 3, "zipf"),
    pytest.param(64, 7168, 2048, 32, 8, "balanced", marks=gpu),
    pytest.param(777, 7168, 2048, 32, 8, "zipf", marks=gpu),
    pytest.param(100, 1000, 200, 8, 4, "zipf", marks=gpu),
    # the "rows<=8" class: 16-row tiles, weights through TMA (not at D = 1000: rows of 1000 bytes)
    pytest.param(1, 7168, 2048, 32, 8, "balanced", marks=gpu),
    pytest.param(6, 1000, 200, 8, 4, "zipf", marks=gpu),
]


@pytest.mark.parametrize(("t", "d", "i", "e", "k", "skew"), FP8_CASES)
def test_fused_moe_fp8_matches_reference(t, d, i, e, k, skew) -> None:
    dtype = torch.bfloat16 if CUDA else torch.float32
    weights, ids = _routing(t, e, k, skew, seed=t)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype)
    w13, w2 = _weights(e, d, i, torch.float32, seed=i)
    (w13_q, w13_s), (w2_q, w2_s) = _quantized(w13), _quantized(w2)
    with poisoned_empty():
        out = tri.fused_moe(x, w13_q, w2_q, weights, ids, w13_s, w2_s)
    expected = ref.fused_moe(x, w13_q, w2_q, weights, ids, w13_s, w2_s)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < FP8_TOL


_PATH_BASE = {"GROUP_M": 2, "warps1": 4, "stages1": 2, "warps2": 4, "stages2": 2, "tma": True}
PATH_CONFIGS = {
    "tma": {**_PATH_BASE, "BLOCK_M": 16, "BLOCK_N1": 32, "BLOCK_K1": 64, "BLOCK_N2": 64,
            "BLOCK_K2": 32},
    "tma-fp8": {**_PATH_BASE, "BLOCK_M": 32, "BLOCK_N1": 128, "BLOCK_K1": 128, "BLOCK_N2": 256,
                "BLOCK_K2": 128},
    "permute-tma": {**_PATH_BASE, "BLOCK_M": 16, "BLOCK_N1": 64, "BLOCK_K1": 64, "BLOCK_N2": 64,
                    "BLOCK_K2": 64, "permute_a": True},
    "permute-tma-fp8": {**_PATH_BASE, "BLOCK_M": 16, "BLOCK_N1": 128, "BLOCK_K1": 128,
                        "BLOCK_N2": 128, "BLOCK_K2": 128, "permute_a": True},
    "tma-act-fp8": {**_PATH_BASE, "BLOCK_M": 16, "BLOCK_N1": 128, "BLOCK_K1": 128,
                    "BLOCK_N2": 64, "BLOCK_K2": 128, "permute_a": True, "tma_act": True},
}  # fmt: skip


def _tma_path_cases() -> list:
    """(path, t, d, i) for each path. I = 192 takes UNIFORM_B False (I not a multiple of the 128 quant
    block) and, at BLOCK_K2 = 128, an uneven down K; I = 256 the even ones. Those differ only for the
    fp8 paths: on CPU the 16-bit paths ("tma", "permute-tma") run at I = 192 alone, the same kernel
    variant as I = 256."""
    cases = []
    for path in sorted(PATH_CONFIGS):
        cases.append(pytest.param(path, 21, 320, 192, id=f"21-320-192-{path}"))
        sweep = () if path.endswith("fp8") else (gpu_sweep,)
        cases.append(pytest.param(path, 19, 320, 256, marks=sweep, id=f"19-320-256-{path}"))
        for t, d, i in ((300, 2048, 640), (300, 2048, 1024)):
            cases.append(pytest.param(path, t, d, i, marks=gpu, id=f"{t}-{d}-{i}-{path}"))
    return cases


@pytest.mark.parametrize(("path", "t", "d", "i"), _tma_path_cases())
def test_weight_tma_paths(path: str, t: int, d: int, i: int) -> None:
    """Weights through TMA descriptors (gate/up tiles that run past I into the up rows, a down
    tile wider than a quant block), x laid out by row first (permute_a), and the activation read
    by the down GEMM through TMA (tma_act), on shapes whose D (and some I) are not multiples of
    128."""
    e, k = 5, 3
    dtype = torch.bfloat16 if CUDA else torch.float32
    weights, ids = _routing(t, e, k, "zipf", seed=i)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(i)).to(DEVICE, dtype)
    w13, w2 = _weights(e, d, i, dtype, seed=d)
    scales: tuple = (None, None)
    if path.endswith("fp8"):
        (w13, w13_s), (w2, w2_s) = _quantized(w13), _quantized(w2)
        scales = (w13_s, w2_s)
    with poisoned_empty():
        out = torch.empty_like(x)
        tri._fused_moe(x, w13, w2, weights, ids, *scales, PATH_CONFIGS[path], out)
    expected = ref.fused_moe(x, w13, w2, weights, ids, *scales)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < (FP8_TOL if path.endswith("fp8") else TOL[dtype])


def test_all_ids_foreign_gives_zeros() -> None:
    x = torch.randn(7, 128, device=DEVICE)
    w13, w2 = _weights(4, 128, 64, torch.float32, seed=0)
    ids = torch.tensor([[-1, 4]] * 7, dtype=torch.int32, device=DEVICE)
    with poisoned_empty():
        out = tri.fused_moe(x, w13, w2, torch.rand(7, 2, device=DEVICE), ids)
    assert torch.equal(out, torch.zeros_like(out))


def _force_atomic_layout(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    if on:  # the multi-program (atomics) layout, which otherwise only takes > 256 assignments
        monkeypatch.setattr(tri_layout, "ONE_PROGRAM_MAX_ASSIGNMENTS", 0)


@pytest.mark.parametrize("atomics", [False, True])
def test_align_rows_pads_each_expert_to_the_tile(monkeypatch, atomics: bool) -> None:
    _force_atomic_layout(monkeypatch, atomics)
    ids = torch.tensor([[2, 0], [2, -1], [5, 2]], dtype=torch.int32, device=DEVICE)
    with poisoned_empty():
        sorted_ids, ends, row_of, max_rows = tri.align_rows(ids, num_experts=4, block_m=4)
    assert ends.tolist() == [4, 4, 8, 8]  # expert 0: 1 row padded to 4; 1: none; 2: 3 rows -> 4
    assert max_rows >= 8 and max_rows % 4 == 0
    flat = ids.reshape(-1).tolist()
    rows = row_of.tolist()
    assert rows[3] == -1 and rows[4] == -1  # id -1 and id 5 >= E
    for a, r in enumerate(rows):
        if r >= 0:
            assert sorted_ids[r].item() == a
            assert (0 if flat[a] == 0 else 4) <= r < ends[flat[a]].item()
    pads = [r for r in range(8) if r not in rows]
    assert all(sorted_ids[r].item() == len(flat) for r in pads)
    if not atomics:  # one program keeps each run in assignment order
        assert [rows[a] for a in (0, 2, 5)] == [4, 5, 6]


@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m"), [(1, 9, 33, 16), (13, 6, 7, 4), (28, 9, 257, 64)]
)
def test_align_rows_one_program_matches_atomics(monkeypatch, tokens, top_k, num_experts, block_m):
    """The two layouts agree on every expert's rows; only the order within a run may differ."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, num_experts + 1, (tokens, top_k), generator=g, dtype=torch.int32)
    ids = ids.to(DEVICE)
    sorted_a, ends_a, row_of_a, max_a = tri.align_rows(ids, num_experts, block_m)
    _force_atomic_layout(monkeypatch, True)
    sorted_b, ends_b, row_of_b, max_b = tri.align_rows(ids, num_experts, block_m)
    assert max_a == max_b and torch.equal(ends_a, ends_b)
    assert torch.equal(row_of_a < 0, row_of_b < 0)
    total = ends_a[-1].item()
    for e in range(num_experts):
        lo, hi = (ends_a[e - 1].item() if e else 0), ends_a[e].item()
        assert sorted(sorted_a[lo:hi].tolist()) == sorted(sorted_b[lo:hi].tolist())
    valid = row_of_a >= 0
    assert torch.equal(sorted_a[row_of_a[valid].long()], valid.nonzero().flatten().int())
    assert (sorted_a[:total] <= ids.numel()).all()


def test_inputs_are_checked() -> None:
    x = torch.randn(3, 128, device=DEVICE)
    w13, w2 = _weights(4, 128, 64, torch.float32, seed=0)
    weights, ids = _routing(3, 4, 2, "balanced", seed=0)
    with pytest.raises(ValueError, match="w2"):
        tri.fused_moe(x, w13, w2[:, :, :32], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        tri.fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="dtype"):
        tri.fused_moe(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="both"):
        tri.fused_moe(x, w13, w2, weights, ids, w13_scale_inv=torch.ones(4, 1, 1, device=DEVICE))
    with pytest.raises(ValueError, match="x_q"):
        tri.fused_moe(x, w13, w2, weights, ids, x_q=quantize_act(x))
    (w13_q, w13_s), (w2_q, w2_s) = _quantized(w13), _quantized(w2)
    for fn in (tri.fused_moe, ref.fused_moe):
        with pytest.raises(ValueError, match="x_q"):
            fn(x, w13_q, w2_q, weights, ids, w13_s, w2_s, quantize_act(x[:2]))
        with pytest.raises(ValueError, match="x_scales"):
            fn(x, w13_q, w2_q, weights, ids, w13_s, w2_s, (quantize_act(x)[0], torch.ones(3, 2)))


@pytest.mark.parametrize("path", ["default", *sorted(p for p in PATH_CONFIGS if p.endswith("fp8"))])
@pytest.mark.parametrize(
    ("t", "d", "i"), [(7, 320, 128), pytest.param(64, 7168, 2048, marks=gpu)]
)  # fmt: skip
def test_x_quantized_by_its_producer_gives_the_same_bits(path: str, t: int, d: int, i: int) -> None:
    """x_q (x quantized in 1x128 groups; scales column-major as rmsnorm(quant=True) hands them out, or
    row-major as rmsnorm(quant="both")): each path, with its own permutation or none, gives the bits
    it gives when it quantizes x; and it reads x_q, not x (x_q of another input gives that input's
    result)."""
    e, k = 8, 3
    dtype = torch.bfloat16 if CUDA else torch.float32
    weights, ids = _routing(t, e, k, "zipf", seed=t)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype)
    w13, w2 = _weights(e, d, i, torch.float32, seed=i)
    (w13_q, w13_s), (w2_q, w2_s) = _quantized(w13), _quantized(w2)
    other = torch.randn(t, d, generator=torch.Generator().manual_seed(d + 1)).to(DEVICE, dtype)
    x_q, other_q = (quantize_tri(v, 128, scale_column_major=True) for v in (x, other))
    x_q_rows = quantize_tri(x, 128, scale_column_major=False)
    assert x_q[1].stride(0) == 1 and x_q_rows[1].stride(1) == 1
    rest = (w13_q, w2_q, weights, ids, w13_s, w2_s)

    def run(v, v_q=None):
        with poisoned_empty():
            if path == "default":
                return tri.fused_moe(v, *rest, v_q)
            return tri._fused_moe(v, *rest, PATH_CONFIGS[path], torch.empty_like(v), v_q)

    want = run(x)
    assert torch.equal(run(x, x_q), want)
    assert torch.equal(run(x, x_q_rows), want)
    assert torch.equal(run(x, other_q), run(other))
    if not CUDA:  # the reference takes x_q the same way
        assert torch.equal(ref.fused_moe(x, *rest, x_q), ref.fused_moe(x, *rest))
        assert torch.equal(ref.fused_moe(x, *rest, other_q), ref.fused_moe(other, *rest))


def _shard(w: torch.Tensor, ids: torch.Tensor, rank: int, ranks: int):
    """Rank `rank`'s experts of `w` and the router's ids as that rank sees them (others' experts: E/N)."""
    per = w.shape[0] // ranks
    owned = (ids >= rank * per) & (ids < (rank + 1) * per)
    return w[rank * per : (rank + 1) * per], torch.where(owned, ids - rank * per, per).int()


TREE_CASES = [
    (13, 64, 64, 16, 4, torch.float32),
    (5, 128, 32, 32, 6, torch.float16),
    pytest.param(64, 7168, 2048, 64, 8, torch.bfloat16, marks=gpu),
    pytest.param(300, 2048, 1408, 64, 6, torch.bfloat16, marks=gpu),
]


@pytest.mark.parametrize("impl", [ref, tri], ids=["ref", "triton"])
@pytest.mark.parametrize(("t", "d", "i", "e", "k", "dtype"), TREE_CASES)
def test_tree_sum_gives_the_same_bits_on_any_expert_split(impl, t, d, i, e, k, dtype) -> None:
    """The expert outputs summed as a tree over 8 groups of experts: N ranks, each holding 8/N groups, give
    subtrees whose tree sum is bit for bit the one-rank result (what batch-invariant expert parallelism
    relies on), and the tree is the slot-order sum to rounding."""
    if impl is tri and dtype is torch.bfloat16 and not CUDA:
        pytest.skip("the Triton interpreter's bf16 dot is wrong")
    if impl is tri and dtype is torch.float16 and not CUDA:
        pytest.skip("the interpreter runs the fp32 case; each case costs it ~13 s")
    weights, ids = _routing(t, e, k, "balanced", seed=t)
    ids = torch.where(ids < 0, e, ids)  # foreign slots: beyond every expert
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    w13, w2 = _weights(e, d, i, dtype, seed=2)
    whole = impl.fused_moe(x, w13, w2, weights, ids, tree=(8, e // 8))
    assert whole.dtype == torch.float32
    slots = impl.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(whole.to(dtype), slots) < TOL[dtype]
    for ranks in (2, 4, 8):
        parts = []
        for rank in range(ranks):
            w13_r, local = _shard(w13, ids, rank, ranks)
            w2_r, _ = _shard(w2, ids, rank, ranks)
            parts.append(impl.fused_moe(x, w13_r, w2_r, weights, local, tree=(8 // ranks, e // 8)))
        assert torch.equal(ref.tree_sum(torch.stack(parts, 1), 1), whole), ranks
    with pytest.raises(ValueError, match="tree=\\(3, 2\\)"):
        impl.fused_moe(x, w13, w2, weights, ids, tree=(3, 2))
