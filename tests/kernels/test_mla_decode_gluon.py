"""The Gluon split kernel of mla_decode for Hopper (kernels/mla_decode/gluon_sm90.py) against the
reference, and against the Triton heads_major kernel it stands in for.

GPU only (Gluon has no CPU interpreter); skipped where Gluon or an sm_90 GPU is missing. Cases
(bf16 and fp16, and fp8 caches under a bf16 q; tolerances of test_mla_decode): 128 heads with one
and two queries, 96 heads (the second 64-row block half empty: its rows read the next request's
queries and are dropped), 16 heads x 4 queries (64 rows: MTP masks inside the last tile), a
256-dim latent, page sizes 64 and 128, chunk ends inside and on tile edges, empty requests, splits
forced and chosen. The cache rows past each request's length, in its own last page, hold NaN: the
partial tile comes through TMA whole, so the kernel must zero them before P V.
"""

from __future__ import annotations

import pytest
import torch
from _decode_check import poisoned_empty, rel_err
from test_mla_decode import Case, _check, _layer_of_page_major, _make

from pdserve.kernels import use_batch_invariant
from pdserve.kernels.mla_decode import gluon_sm90, ref
from pdserve.kernels.mla_decode import triton as tri

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if not torch.cuda.is_available() or not gluon_sm90.available(torch.device("cuda", 0)):
        pytest.skip("needs Triton's Gluon and an sm_90 GPU")


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Counts the Gluon kernel's launches."""
    calls: list[int] = []
    real = gluon_sm90.launch

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_sm90, "launch", spy)
    return calls


def _make_poisoned(case: Case, seed: int):
    """`_make`'s inputs with NaN in every cache row past a request's length in its own pages (in
    an fp8 cache: bytes that are NaN in e4m3 and huge as the rope's bf16 and the scale's fp32)."""
    q, cache, page_table, seq_lens = _make(case, seed)
    cache = cache.clone()
    poison = 0x7F if case.fp8 else float("nan")
    for b, n in enumerate(case.seq_lens):
        pages = max(1, -(-n // case.page_size))
        pos = torch.arange(n, pages * case.page_size, device=cache.device)
        rows = page_table[b, pos // case.page_size].long()
        cache[rows, pos % case.page_size] = poison
    return q, cache, page_table, seq_lens


B16 = torch.bfloat16
CASES = [
    pytest.param(Case((1, 3000, 128, 999, 4097, 64, 65), 1, 128, 64, B16), id="q1-h128-p64"),
    pytest.param(Case((3, 2000, 517, 1025, 0), 2, 128, 128, B16), id="q2-h128-p128"),
    pytest.param(Case((70, 9, 130, 2), 1, 96, 64, B16), id="q1-h96-p64"),
    pytest.param(Case((0, 70, 9, 130, 3), 4, 16, 64, torch.float16), id="q4-h16-p64-f16"),
    pytest.param(Case((300, 64, 1000), 1, 128, 64, B16, lora=256), id="q1-h128-lora256"),
    pytest.param(Case((70,), 3, 16, 64, B16), id="b1-48-rows"),  # fewer rows than a TMA box
    pytest.param(Case((1, 3000, 128, 999, 4097, 64, 65), 1, 128, 64, B16, True), id="q1-h128-fp8"),
    pytest.param(Case((3, 2000, 517, 1025, 0), 2, 128, 128, B16, True), id="q2-h128-p128-fp8"),
    pytest.param(Case((70, 9, 130, 2), 1, 96, 64, B16, True), id="q1-h96-fp8"),
]


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("case", CASES)
def test_gluon_matches_ref(case: Case, num_splits: int | None, launches: list[int]) -> None:
    q, cache, page_table, seq_lens = _make_poisoned(case, seed=len(case.seq_lens) + case.heads)
    scale = (case.lora + case.rope) ** -0.5
    clean = cache if case.fp8 else cache.nan_to_num()
    expected = ref.mla_decode(q, clean, page_table, seq_lens, scale, case.lora)
    with poisoned_empty():
        got = tri.mla_decode_launch(q, cache, page_table, seq_lens, scale, case.lora, num_splits)
    assert launches, "the tuned config did not pick the Gluon kernel"
    _check(case, got, expected)


@pytest.mark.parametrize("case", CASES[:2])
def test_gluon_agrees_with_triton_heads_major(case: Case, launches: list[int]) -> None:
    """Same inputs, the Gluon kernel and the Triton one (gluon off): both within bf16's rounding
    of each other (P is rounded to bf16 in both before P V)."""
    q, cache, page_table, seq_lens = _make(case, seed=3)
    out_g, lse_g = tri.mla_decode_launch(q, cache, page_table, seq_lens, 0.07, case.lora, 3)
    assert launches
    out_t, lse_t = tri.mla_decode_launch(
        q, cache, page_table, seq_lens, 0.07, case.lora, 3, {"gluon": False}
    )
    assert len(launches) == 1
    assert rel_err(out_g, out_t) < 1e-2
    seen = lse_t != float("-inf")
    assert torch.equal(lse_g != float("-inf"), seen)
    assert (lse_g[seen] - lse_t[seen]).abs().max().item() < 1e-3


def test_gluon_reads_a_layer_of_a_page_major_cache(launches: list[int]) -> None:
    case = Case((3, 1900, 257, 4096), 1, 128, 64, B16)
    q, cache, page_table, seq_lens = _make(case, seed=11)
    expected = ref.mla_decode(q, cache, page_table, seq_lens, 0.1, case.lora)
    with poisoned_empty():
        got = tri.mla_decode_launch(q, _layer_of_page_major(cache), page_table, seq_lens, 0.1,
                                    case.lora, 3)  # fmt: skip
    assert launches
    _check(case, got, expected)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gluon_batch_invariant_mode(fp8: bool, launches: list[int]) -> None:
    """Fixed-length chunks (splits past a request's end write nothing the combine reads): a
    request's result is the same alone or in the batch."""
    case = Case((700, 33, 1500), 1, 128, 64, B16, fp8)
    q, cache, page_table, seq_lens = _make_poisoned(case, seed=5)
    with use_batch_invariant():
        out, lse = tri.mla_decode(q, cache, page_table, seq_lens, 0.1, case.lora)
        one = tri.mla_decode(q[1:2], cache, page_table[1:2], seq_lens[1:2], 0.1, case.lora)
    assert launches
    assert torch.equal(one[0], out[1:2]) and torch.equal(one[1], lse[1:2])
    want = ref.mla_decode(q, cache if fp8 else cache.nan_to_num(), page_table, seq_lens, 0.1,
                          case.lora)  # fmt: skip
    _check(case, (out, lse), want)


@pytest.mark.parametrize(
    "page_size,fp8,config",
    [(16, False, None), (64, True, None), (64, False, {"gluon": False})],
    ids=["page16", "fp8-cache-fp16-q", "gluon-off"],
)
def test_gluon_falls_back(page_size: int, fp8: bool, config, launches: list[int]) -> None:
    """Pages smaller than a tile, an fp8 cache under an fp16 q (its rope part is bf16), or the
    config's switch off: the Triton kernel."""
    case = Case((5, 300), 1, 128, page_size, torch.float16 if fp8 else B16, fp8)
    q, cache, page_table, seq_lens = _make(case, seed=2)
    got = tri.mla_decode_launch(q, cache, page_table, seq_lens, 0.1, case.lora, None, config)
    assert not launches
    _check(case, got, ref.mla_decode(q, cache, page_table, seq_lens, 0.1, case.lora))
