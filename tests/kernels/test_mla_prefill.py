"""Triton mla_prefill / merge_attn_states against the torch reference on ragged varlen batches.

Tolerances (||out - ref|| / ||ref||, ref computed in fp32 from the same inputs): fp32 1e-4 (IEEE
dots), fp16 and bf16 1e-2 (P is rounded to the input dtype before the P @ V dot). LSE: 1e-3 absolute
for every dtype (scores accumulate in fp32); -inf exactly where the reference has it. On CPU the
kernels run in the Triton interpreter, whose bf16 dot is wrong, so CPU cases use fp32 and fp16; the
bf16 cases are GPU-only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _kernel_check import DEVICE, poison_outputs, rel_err

from pdserve import kernels
from pdserve.kernels.mla_prefill import ref
from pdserve.kernels.mla_prefill import triton as tri

OUT_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    heads: int
    dtype: torch.dtype
    causal: bool
    dqk: int = 192
    dv: int = 128


CASES = [
    # tiny, interpreter-sized: ragged, length-1 sequences, odd head counts, non-power-of-two qk dim
    pytest.param(Case((1, 7, 33, 16), (1, 7, 33, 16), 3, torch.float32, True, 48, 32), id="f32"),
    pytest.param(Case((1, 17, 40), (1, 17, 40), 2, torch.float32, True), id="self-f32-v3dims"),
    pytest.param(Case((1, 5, 20), (0, 13, 40), 5, torch.float16, False, 40, 16), id="prefix-f16"),
    pytest.param(Case((6, 1, 9), (3, 4, 30), 1, torch.float32, True, 24, 32), id="lq>lk-causal"),
    # realistic, bf16 on the GPU
    pytest.param(
        Case((1, 100, 1000, 3000), (1, 100, 1000, 3000), 16, torch.bfloat16, True),
        marks=pytest.mark.gpu, id="self-bf16-h16",
    ),
    pytest.param(
        Case((1, 257, 2048), (1, 257, 2048), 128, torch.bfloat16, True),
        marks=pytest.mark.gpu, id="self-bf16-h128",
    ),
    pytest.param(
        Case((1, 300, 1024, 77), (0, 2000, 513, 1), 128, torch.bfloat16, False),
        marks=pytest.mark.gpu, id="prefix-bf16-h128",
    ),
]  # fmt: skip


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return torch.tensor(offsets, dtype=torch.int32, device=DEVICE)


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tq, tk = sum(case.q_lens), sum(case.k_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(case.dtype)

    q = randn(tq, case.heads, case.dqk)
    k = randn(tk, case.heads, case.dqk)
    v = randn(tk, case.heads, case.dv)
    return q, k, v, _cu(case.q_lens), _cu(case.k_lens)


def _check(out, lse, ref_out, ref_lse, dtype: torch.dtype) -> None:
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (poisoned) outputs"
    err = rel_err(out, ref_out)
    assert err < OUT_TOL[dtype], f"out rel err {err:.2e} >= {OUT_TOL[dtype]:.0e}"
    no_key = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), no_key)
    if (~no_key).any():
        lse_err = (lse[~no_key] - ref_lse[~no_key]).abs().max().item()
        assert lse_err < LSE_TOL, f"lse max abs err {lse_err:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_mla_prefill_matches_ref(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    poison_outputs(monkeypatch, tri)
    q, k, v, cu_q, cu_k = _inputs(case, seed=sum(case.q_lens) + case.heads)
    scale = case.dqk**-0.5
    out, lse = tri.mla_prefill(q, k, v, cu_q, cu_k, scale, case.causal)
    ref_out, ref_lse = ref.mla_prefill(q, k, v, cu_q, cu_k, scale, case.causal)
    _check(out, lse, ref_out, ref_lse, case.dtype)


TMA_CASES = [
    pytest.param(Case((1, 17, 40), (1, 17, 40), 2, torch.float32, True), id="causal-f32"),
    pytest.param(Case((1, 5, 20), (0, 13, 40), 3, torch.float16, False), id="prefix-f16"),
    pytest.param(
        Case((1, 300, 1024, 77), (0, 2000, 513, 1), 128, torch.bfloat16, False),
        marks=pytest.mark.gpu, id="prefix-bf16-h128",
    ),
    pytest.param(
        Case((1, 257, 2048), (1, 257, 2048), 16, torch.bfloat16, True),
        marks=pytest.mark.gpu, id="causal-bf16-h16",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", TMA_CASES)
def test_tma_path_ignores_rows_past_the_keys(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """K and V through TMA descriptors over [tokens, heads * dim]: a key tile reads rows past its
    sequence (the next sequence's, or NaN rows past cu_seqlens_k[-1] here) and must not let them
    into the result."""
    poison_outputs(monkeypatch, tri)
    tiles = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    if DEVICE != "cpu":
        tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    monkeypatch.setattr(tri, "lookup", lambda *_: {**tiles, "tma": True})
    q, k, v, cu_q, cu_k = _inputs(case, seed=5)
    nan_rows = 7
    k = torch.cat([k, torch.full_like(k[:nan_rows], float("nan"))])
    v = torch.cat([v, torch.full_like(v[:nan_rows], float("nan"))])
    assert tri._tma_fits(k, v, True)
    scale = case.dqk**-0.5
    out, lse = tri.mla_prefill(q, k, v, cu_q, cu_k, scale, case.causal)
    ref_out, ref_lse = ref.mla_prefill(q, k, v, cu_q, cu_k, scale, case.causal)
    _check(out, lse, ref_out, ref_lse, case.dtype)


CHUNK_CASES = [
    pytest.param((2, 9, 1), (0, 20, 5), 3, torch.float32, 48, 32, id="f32"),
    pytest.param((700, 1, 64), (1000, 5, 0), 128, torch.bfloat16, 192, 128, marks=pytest.mark.gpu,
                 id="bf16-h128"),
]  # fmt: skip


@pytest.mark.parametrize(("chunk_lens", "prefix_lens", "heads", "dtype", "dqk", "dv"), CHUNK_CASES)
def test_chunked_prefill_merge(
    chunk_lens, prefix_lens, heads, dtype, dqk, dv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Causal over the chunk + non-causal over the cached prefix, merged by LSE, equals causal
    attention over prefix + chunk (the reference, bottom-right aligned)."""
    poison_outputs(monkeypatch, tri)
    chunk = Case(chunk_lens, chunk_lens, heads, dtype, True, dqk, dv)
    q, k_c, v_c, cu_q, _ = _inputs(chunk, seed=1)
    prefix = Case(chunk_lens, prefix_lens, heads, dtype, False, dqk, dv)
    _, k_p, v_p, _, cu_p = _inputs(prefix, seed=2)
    scale = dqk**-0.5
    out_c, lse_c = tri.mla_prefill(q, k_c, v_c, cu_q, cu_q, scale, True)
    out_p, lse_p = tri.mla_prefill(q, k_p, v_p, cu_q, cu_p, scale, False)
    out, lse = tri.merge_attn_states(out_c, lse_c, out_p, lse_p)
    ref_m_out, ref_m_lse = ref.merge_attn_states(out_c, lse_c, out_p, lse_p)
    _check(out, lse, ref_m_out, ref_m_lse, torch.float32)  # same inputs: only fp32 rounding differs

    # the whole: each sequence's keys are its prefix then its chunk
    cp, cc = cu_p.tolist(), cu_q.tolist()
    seqs = range(len(chunk_lens))
    k_all = torch.cat([t for b in seqs for t in (k_p[cp[b] : cp[b + 1]], k_c[cc[b] : cc[b + 1]])])
    v_all = torch.cat([t for b in seqs for t in (v_p[cp[b] : cp[b + 1]], v_c[cc[b] : cc[b + 1]])])
    cu_all = _cu(tuple(p + c for p, c in zip(prefix_lens, chunk_lens, strict=True)))
    ref_out, ref_lse = ref.mla_prefill(q, k_all, v_all, cu_q, cu_all, scale, True)
    _check(out, lse, ref_out, ref_lse, dtype)


def test_dispatch_runs_triton() -> None:
    case = Case((3, 2), (3, 2), 2, torch.float32, True, 32, 16)
    q, k, v, cu_q, cu_k = _inputs(case, seed=3)
    with kernels.use_backend("triton"):
        out, lse = kernels.mla_prefill(q, k, v, cu_q, cu_k, 0.3, True)
    ref_out, ref_lse = ref.mla_prefill(q, k, v, cu_q, cu_k, 0.3, True)
    _check(out, lse, ref_out, ref_lse, torch.float32)


def test_rejects_bad_inputs() -> None:
    q, k, v, cu_q, cu_k = _inputs(Case((3,), (3,), 2, torch.float32, True, 32, 16), seed=4)
    with pytest.raises(ValueError, match="head dim"):
        tri.mla_prefill(q, k[..., :16], v, cu_q, cu_k, 0.3, True)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        tri.mla_prefill(q, k, v, cu_q, cu_k.float(), 0.3, True)
    with pytest.raises(ValueError, match="dtypes differ"):
        tri.mla_prefill(q, k.half(), v, cu_q, cu_k, 0.3, True)
    with pytest.raises(ValueError, match="lse"):
        tri.merge_attn_states(v, torch.zeros(3, 2), v, torch.zeros(3, 2, dtype=torch.float16))
