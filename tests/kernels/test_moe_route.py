"""Triton moe_route (noaux_tc) against the torch reference: DeepSeek-V3 (256 experts, 8 groups, 4
kept, top-8), V2-Lite-shaped (64 experts, one group, top-6) and an odd shape (160 experts in 8
groups of 20, top-6).

Compared as sets sorted by expert id (the reference's top-k order on ties is unspecified): ids
equal; weights within 1e-6 absolute + 1e-5 relative (both compute sigmoid in fp32; only rounding
order differs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _kernel_check import DEVICE, poison_outputs

from pdserve import kernels
from pdserve.kernels.moe_route import ref
from pdserve.kernels.moe_route import triton as tri


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    experts: int
    n_group: int
    topk_group: int
    top_k: int
    bias: bool
    scale: float
    normalize: bool
    dtype: torch.dtype = torch.float32

    def args(self, seed: int):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        logits = torch.randn(self.tokens, self.experts, generator=gen, device=DEVICE).to(self.dtype)
        bias = torch.randn(self.experts, generator=gen, device=DEVICE) * 0.3 if self.bias else None
        return (logits, bias, self.top_k, self.n_group, self.topk_group, self.scale, self.normalize)


V3 = dict(experts=256, n_group=8, topk_group=4, top_k=8, bias=True, scale=2.5, normalize=True)
V2_LITE = dict(experts=64, n_group=1, topk_group=1, top_k=6, bias=False, scale=1.0, normalize=False)
ODD = dict(experts=160, n_group=8, topk_group=3, top_k=6, bias=True, scale=16.0, normalize=True)

CASES = [
    # v3-t11: two programs of BLOCK_T (8 on CPU), the last ragged; v3-t37 is that path on more programs
    pytest.param(Case(11, **V3), id="v3-t11"),
    pytest.param(Case(37, **V3), marks=pytest.mark.gpu_sweep, id="v3-t37"),
    pytest.param(Case(1, **V2_LITE), id="v2lite-t1"),
    pytest.param(Case(19, **ODD), id="odd-t19"),
    pytest.param(Case(13, **V3, dtype=torch.bfloat16), id="v3-t13-bf16"),
    pytest.param(Case(8192, **V3), marks=pytest.mark.gpu, id="v3-t8192"),
    pytest.param(Case(4097, **V2_LITE), marks=pytest.mark.gpu, id="v2lite-t4097"),
    pytest.param(Case(1000, **ODD), marks=pytest.mark.gpu, id="odd-t1000"),
]


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.long().sort(dim=1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("case", CASES)
def test_moe_route_matches_ref(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    poison_outputs(monkeypatch, tri)
    args = case.args(seed=case.tokens)
    weights, ids = tri.moe_route(*args)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (case.tokens, case.top_k)
    ref_weights, ref_ids = ref.moe_route(*args)
    w, i = _sorted_by_id(weights, ids)
    rw, ri = _sorted_by_id(ref_weights, ref_ids)
    bad = (i != ri).any(1).nonzero().flatten().tolist()
    assert not bad, f"tokens differ: {bad[:10]}"
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_t", [1, 2])
def test_small_token_blocks(block_t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs route 256 experts one token a program (tuning); the interpreter checks that indexing too."""
    from pdserve.kernels import tuning

    table = {**tuning._TABLES["moe_route"]}
    table["cpu"] = {"default": {"BLOCK_T": block_t, "num_warps": 1}}
    monkeypatch.setitem(tuning._TABLES, "moe_route", table)
    poison_outputs(monkeypatch, tri)
    case = Case(5, **V3)
    args = case.args(seed=block_t)
    weights, ids = tri.moe_route(*args, num_shared=1)
    ref_w, ref_ids = ref.moe_route(*args, num_shared=1)
    w, i = _sorted_by_id(weights, ids)
    rw, ri = _sorted_by_id(ref_w, ref_ids)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("case", "num_shared"),
    [
        (Case(11, **V3), 1),
        (Case(6, **ODD), 2),
        pytest.param(Case(300, **V3), 1, marks=pytest.mark.gpu),
    ],
)
def test_shared_experts_ride_after_the_routed_ones(
    case: Case, num_shared: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_shared appends ids E.. with weight 1 after the routed columns, which stay as without it."""
    poison_outputs(monkeypatch, tri)
    args = case.args(seed=case.tokens + 1)
    weights, ids = tri.moe_route(*args, num_shared=num_shared)
    plain_w, plain_ids = tri.moe_route(*args)
    assert weights.shape == ids.shape == (case.tokens, case.top_k + num_shared)
    k = case.top_k
    assert torch.equal(ids[:, :k], plain_ids) and torch.equal(weights[:, :k], plain_w)
    shared = torch.arange(case.experts, case.experts + num_shared, device=ids.device)
    assert torch.equal(ids[:, k:], shared.to(torch.int32).expand(case.tokens, -1))
    assert torch.equal(weights[:, k:], torch.ones_like(weights[:, k:]))
    ref_w, ref_ids = ref.moe_route(*args, num_shared=num_shared)
    assert torch.equal(ref_ids[:, k:], ids[:, k:]) and torch.equal(ref_w[:, k:], weights[:, k:])
    assert torch.equal(
        _sorted_by_id(ref_w[:, :k], ref_ids[:, :k])[1], _sorted_by_id(plain_w, plain_ids)[1]
    )


def test_dispatch_runs_triton() -> None:
    args = Case(5, **V3).args(seed=3)
    with kernels.use_backend("triton"):
        weights, ids = kernels.moe_route(*args)
    ref_weights, ref_ids = ref.moe_route(*args)
    assert torch.equal(_sorted_by_id(weights, ids)[1], _sorted_by_id(ref_weights, ref_ids)[1])


def test_rejects_bad_inputs() -> None:
    logits, bias, *_ = Case(4, **V3).args(seed=4)
    with pytest.raises(ValueError, match="n_group"):
        tri.moe_route(logits, bias, 8, 7, 4, 1.0, True)
    with pytest.raises(ValueError, match="topk_group"):
        tri.moe_route(logits, bias, 8, 8, 9, 1.0, True)
    with pytest.raises(ValueError, match="top_k"):
        tri.moe_route(logits, bias, 129, 8, 4, 1.0, True)
    with pytest.raises(ValueError, match="correction_bias"):
        tri.moe_route(logits, bias[:10], 8, 8, 4, 1.0, True)
    with pytest.raises(ValueError, match="num_shared"):
        tri.moe_route(logits, bias, 8, 8, 4, 1.0, True, -1)
