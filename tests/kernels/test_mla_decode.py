"""Triton mla_decode (bf16 / fp16 / fp32 and fp8 caches), write_kv and write_kv_fp8 against the references.

Every case runs on a shuffled page pool with ragged sequence lengths, Q = 1..4 query tokens per
request (causal among them) and page sizes 1, 16 and 64; some requests have fewer positions than
queries (their first queries see nothing: out 0, lse -inf).

Tolerances, with the reference in fp32 from the same inputs: out ||out - ref|| / ||ref|| <= 1e-4
for fp32 (IEEE dots), 5e-3 for fp16 and 1.5e-2 for bf16 (P is rounded to the input dtype before the
P @ V dot); lse within 1e-3 absolute (the scores accumulate in fp32), and -inf exactly where the
reference has it. An fp8 cache is checked against the reference on the same fp8 rows, so it has
its q dtype's tolerance. On CPU the kernels run in the interpreter at tiny sizes in fp32 / fp16;
bf16 and DeepSeek-V3 sizes are GPU cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _decode_check import DEVICE, exact_fp8_rows, poisoned_empty, rel_err

from pdserve.kernels import use_batch_invariant
from pdserve.kernels._backend import num_sms
from pdserve.kernels.mla_decode import fp8_format, ref
from pdserve.kernels.mla_decode import mla_decode as mla_decode_dispatch
from pdserve.kernels.mla_decode import triton as tri

gpu_sweep = pytest.mark.gpu_sweep
OUT_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}
LSE_TOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    num_q: int
    heads: int
    page_size: int
    dtype: torch.dtype
    fp8: bool = False
    lora: int = 512
    rope: int = 64


CASES = [
    # tiny, interpreter-sized
    pytest.param(Case((1, 7, 20), 1, 3, 1, torch.float32, lora=32, rope=16), id="q1-h3-p1-f32"),
    pytest.param(Case((2, 37), 4, 5, 16, torch.float16, lora=64, rope=16), id="q4-h5-p16-f16"),
    pytest.param(Case((0, 70, 9, 130), 2, 16, 64, torch.float32, False, 32, 16), id="q2-h16-p64"),
    pytest.param(Case((5, 41, 3), 3, 4, 16, torch.float32, True, 32, 16), id="q3-h4-p16-fp8"),
    # DeepSeek-V3 sizes on the GPU
    pytest.param(Case((1, 4000, 777, 2048, 64, 3001, 15, 1200), 1, 16, 64, torch.bfloat16),
                 marks=pytest.mark.gpu, id="q1-h16-p64-bf16"),
    pytest.param(Case((3, 2000, 517, 1025), 4, 128, 16, torch.bfloat16),
                 marks=pytest.mark.gpu, id="q4-h128-p16-bf16"),
    pytest.param(Case((700, 2, 333, 64, 1), 2, 16, 1, torch.bfloat16),
                 marks=pytest.mark.gpu, id="q2-h16-p1-bf16"),
    pytest.param(Case((1, 3000, 128, 999, 4097), 1, 128, 64, torch.bfloat16),
                 marks=pytest.mark.gpu, id="q1-h128-p64-bf16"),
    pytest.param(Case((1, 3000, 128, 999), 1, 128, 64, torch.bfloat16, True),
                 marks=pytest.mark.gpu, id="q1-h128-p64-fp8"),
    pytest.param(Case((2, 1500, 4096, 31), 3, 16, 16, torch.bfloat16, True),
                 marks=pytest.mark.gpu, id="q3-h16-p16-fp8"),
]  # fmt: skip


def _make(case: Case, seed: int):
    """q, cache, page_table (shuffled pages, unused entries point at a poisoned page), seq_lens."""
    g = torch.Generator().manual_seed(seed)
    batch, dk = len(case.seq_lens), case.lora + case.rope
    pages_per_req = [max(1, -(-n // case.page_size)) for n in case.seq_lens]
    max_pages = max(pages_per_req) + 1  # a spare column: the kernel must not read past seq_len
    num_pages = sum(pages_per_req) + 1
    order = torch.randperm(num_pages - 1, generator=g)  # page num_pages - 1 is never assigned
    page_table = torch.full((batch, max_pages), num_pages - 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_req):
        page_table[b, :n] = order[start : start + n].int()
        start += n
    q = torch.randn(batch, case.num_q, case.heads, dk, generator=g)
    c_kv = torch.randn(num_pages * case.page_size, case.lora, generator=g)
    k_pe = torch.randn(num_pages * case.page_size, case.rope, generator=g)
    if case.fp8:
        cache = ref.quantize_kv_fp8(c_kv, k_pe).view(num_pages, case.page_size, -1)
        cache[-1].view(torch.float32)[:, -4:] = float("nan")  # poison the spare page's scales
    else:
        cache = torch.cat([c_kv, k_pe], -1).view(num_pages, case.page_size, dk).to(case.dtype)
        cache[-1] = float("nan")  # the spare page: any read of it poisons the output
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    to = {"device": DEVICE}
    return (q.to(case.dtype).to(**to), cache.to(**to), page_table.to(**to), seq_lens.to(**to))


def _check(case: Case, got: tuple[torch.Tensor, torch.Tensor], expected) -> None:
    out, lse = got
    out_ref, lse_ref = expected
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype
    assert lse.shape == lse_ref.shape and lse.dtype == torch.float32
    err = rel_err(out, out_ref)
    assert err <= OUT_TOL[case.dtype], f"out rel err {err:.2e}"
    hidden = lse_ref == float("-inf")
    assert torch.equal(lse == float("-inf"), hidden)
    assert (lse[~hidden] - lse_ref[~hidden]).abs().max().item() <= LSE_TOL
    assert torch.equal(out[hidden], torch.zeros_like(out[hidden]))


@pytest.mark.parametrize("case", CASES)
def test_mla_decode_matches_ref(case: Case) -> None:
    q, cache, page_table, seq_lens = _make(case, seed=len(case.seq_lens) * 31 + case.heads)
    scale = (case.lora + case.rope) ** -0.5
    expected = ref.mla_decode(q, cache, page_table, seq_lens, scale, case.lora)
    with poisoned_empty():
        got = tri.mla_decode(q, cache, page_table, seq_lens, scale, case.lora)
    _check(case, got, expected)


LAYOUT_CASES = [
    pytest.param(Case((3, 50, 17), 2, 6, 16, torch.float32, lora=32, rope=16), id="f32"),
    pytest.param(Case((3, 50, 17), 2, 6, 16, torch.float32, True, 32, 16), id="f32-fp8"),
    pytest.param(Case((3, 1900, 257, 4096), 2, 16, 64, torch.bfloat16),
                 marks=pytest.mark.gpu, id="bf16"),
    pytest.param(Case((3, 1900, 257, 4096), 1, 128, 64, torch.bfloat16, True),
                 marks=pytest.mark.gpu, id="bf16-fp8"),
]  # fmt: skip


# On CPU: 1 split (no combine; several tiles a split) and 6 (the combine's loop of chunks, a partial
# last chunk, empty splits). 3 splits (several tiles a split, then the combine) is the split count of
# test_mla_decode_reads_a_layer_of_a_page_major_cache, which runs the same cases, layouts and loads
# on CPU; 20 is 6's code path on more splits.
SPLIT_COUNTS = [1, pytest.param(3, marks=gpu_sweep), 6, pytest.param(20, marks=gpu_sweep)]


@pytest.mark.parametrize("use_tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
@pytest.mark.parametrize("layout", ["heads_major", "kv_major"])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_mla_decode_layouts_and_splits(
    case: Case, layout: str, num_splits: int, use_tma: bool
) -> None:
    """Both split kernels, pointer or TMA loads, with and without the combine step, whatever the
    tuning table picks; from 6 splits the combine reads them a few at a time (a loop of chunks)."""
    q, cache, page_table, seq_lens = _make(case, seed=7)
    scale = 0.1
    expected = ref.mla_decode(q, cache, page_table, seq_lens, scale, case.lora)
    config = {"LAYOUT": layout, "USE_TMA": use_tma}
    if num_splits >= 6:
        config |= {"COMBINE_TILE": 64}
    if DEVICE == "cpu":
        config |= {"BLOCK_M": 16, "BLOCK_N": 16}
    with poisoned_empty():
        got = tri.mla_decode_launch(
            q, cache, page_table, seq_lens, scale, case.lora, num_splits, config
        )
    _check(case, got, expected)


FP8_SPLIT_KERNELS = {
    "triton": {"gluon": False},
    "gluon-n64": {"gluon": True, "BLOCK_N": 64, "gluon_stages": 2},
    "gluon-n32": {"gluon": True, "BLOCK_N": 32, "gluon_stages": 4},
}


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("kernel", list(FP8_SPLIT_KERNELS))
@pytest.mark.parametrize(
    "case",
    [
        Case((1, 3000, 128, 999, 4097), 1, 128, 64, torch.bfloat16, True),
        Case((3, 2000, 517, 1025), 2, 128, 16, torch.bfloat16, True),
        Case((700, 2, 64, 1), 1, 64, 64, torch.bfloat16, True),
    ],
    ids=["q1-h128-p64", "q2-h128-p16", "q1-h64-p64"],
)
def test_mla_decode_fp8_heads_major_kernels(case: Case, kernel: str, num_splits) -> None:
    """The fp8 cache's 64-row split kernels (Triton, and the Gluon one with 64- and 32-position
    tiles) on a cache whose rows past each request's end hold NaN bytes: the Gluon kernel loads
    a partial last tile whole, and must zero those rows and their scales, not read them."""
    q, cache, page_table, seq_lens = _make(case, seed=5)
    for b, n in enumerate(case.seq_lens):
        if n % case.page_size:
            cache[page_table[b, n // case.page_size].long(), n % case.page_size :] = 0x7F
    expected = ref.mla_decode(q, cache, page_table, seq_lens, 0.1, case.lora)
    config = FP8_SPLIT_KERNELS[kernel]
    with poisoned_empty():
        got = tri.mla_decode_launch(
            q, cache, page_table, seq_lens, 0.1, case.lora, num_splits, config
        )
    _check(case, got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(FP8_SPLIT_KERNELS))
def test_mla_decode_fp8_converts_every_byte_exactly(kernel: str) -> None:
    """Every e4m3 byte but the two NaNs (subnormals, zeros and both signs included), twice over
    a 512-wide latent, in 64 identical cache rows with a power-of-two scale: each output is then
    one dequantized value, exactly, so out must equal the reference bit for bit."""
    lora, rope, tokens = 512, 64, 64
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    row = torch.zeros(fp8_format.row_bytes(lora, rope), dtype=torch.uint8)
    row[:lora] = torch.cat([codes, codes.flip(0)]).to(torch.uint8)
    scale_at = fp8_format.scale_offset(lora, rope)
    row[scale_at : scale_at + 4] = torch.tensor([0.125]).view(torch.uint8)
    cache = row.repeat(tokens, 1).view(1, tokens, -1).cuda()
    q = torch.randn(1, 1, 128, lora + rope).bfloat16().cuda()
    page_table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    want, _ = ref.mla_decode(q, cache, page_table, seq_lens, 0.1, lora)
    got, _ = tri.mla_decode_launch(
        q, cache, page_table, seq_lens, 0.1, lora, 1, FP8_SPLIT_KERNELS[kernel]
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_heads_major_running_max_across_tiles(num_splits: int) -> None:
    """Scores that climb along the cache, steeply (0.5 a position) and slowly (0.05): the running
    max (kept unscaled, in the units of Q K^T) rises at every tile and the accumulator follows."""
    case = Case((200, 150), 1, 4, 16, torch.float32, lora=32, rope=16)
    q, cache, page_table, seq_lens = _make(case, seed=11)
    q, cache = q.clone(), cache.clone()
    q[..., 0] = 1.0
    for b, slope in enumerate((0.5, 0.05)):
        pos = torch.arange(case.seq_lens[b], device=cache.device)
        page = page_table[b, pos // case.page_size].long()
        cache[page, pos % case.page_size, 0] = slope * pos.to(cache.dtype)
    expected = ref.mla_decode(q, cache, page_table, seq_lens, 1.0, case.lora)
    config = {"LAYOUT": "heads_major", "BLOCK_M": 16, "BLOCK_N": 16, "USE_TMA": False}
    got = tri.mla_decode_launch(q, cache, page_table, seq_lens, 1.0, case.lora, num_splits, config)
    _check(case, got, expected)


def test_split_policy_choices() -> None:
    """The policy's split counts at 128 heads (2 programs a request a split), 64-token tiles, 132
    SMs, as measured best on an H200: one tile a split only while the programs fill at most half the
    SMs (0.9-1.5 us faster at batch 1-4 up to 2048 tokens), else at least two (one tile a split
    lost with 128 programs)."""
    cfg = {"MAX_SPLITS": 128, "MIN_TILES_PER_SPLIT": 2, "CTAS_PER_SM": 1, "SPLIT_OVERHEAD_TILES": 2}

    def splits(batch: int, context: int) -> int:
        return tri.choose_num_splits(batch, 2, context, 64, cfg, 132)

    assert splits(1, 512) == 8 and splits(1, 1024) == 16 and splits(1, 2048) == 32
    assert splits(1, 4096) == 32  # 64 splits would make 128 programs
    assert splits(4, 512) == 8 and splits(4, 1024) == 8
    assert splits(16, 1024) == 4 and splits(64, 1024) == 1
    assert splits(1, 64) == 1  # one tile: nothing to split


def test_combine_tiles_narrow_for_few_rows() -> None:
    """Few rows (batch 1, a long cache cut into many splits): latent blocks shrink until the
    programs fill the SMs; many rows take the whole latent (COMBINE_MAX_D) a program. Chunks hold
    about COMBINE_TILE elements and never more splits than there are."""
    cfg = {"COMBINE_PROGRAMS_PER_SM": 4, "COMBINE_TILE": 4096, "COMBINE_MAX_D": 512}
    assert tri.combine_tiles(16, 128, 512, cfg, 132) == (16, 128)  # 512 programs
    assert tri.combine_tiles(128, 64, 512, cfg, 132) == (64, 64)  # 1024 programs
    assert tri.combine_tiles(512, 16, 512, cfg, 132) == (256, 16)  # 1024 programs
    assert tri.combine_tiles(4096, 4, 512, cfg, 132) == (512, 4)
    assert tri.combine_tiles(4096, 4, 64, cfg, 132) == (64, 4)  # a narrower latent
    assert tri.combine_tiles(1, 2, 512, cfg, 132) == (16, 2)  # never under 16 dims


def _layer_of_page_major(cache: torch.Tensor, layers: int = 3, layer: int = 1) -> torch.Tensor:
    """`cache` [P, S, W] as layer `layer` of a page-major cache [P, layers, S, W] whose other layers
    are poison (NaN, or 0xFF bytes: NaN codes and scales): pages lie layers * S rows apart."""
    poison = 0xFF if cache.dtype == torch.uint8 else float("nan")
    big = torch.full((cache.shape[0], layers, *cache.shape[1:]), poison, dtype=cache.dtype)
    big = big.to(cache.device)
    big[:, layer] = cache
    return big[:, layer]


@pytest.mark.parametrize("use_tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("layout", ["heads_major", "kv_major"])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_mla_decode_reads_a_layer_of_a_page_major_cache(
    case: Case, layout: str, use_tma: bool
) -> None:
    """The worker's cache is page-major ([pages, layers, page_size, width], kv_cache.PagedKVCache):
    one layer's pages lie apart, by the page stride, and the TMA descriptors span them."""
    q, cache, page_table, seq_lens = _make(case, seed=11)
    expected = ref.mla_decode(q, cache, page_table, seq_lens, 0.1, case.lora)
    layer = _layer_of_page_major(cache)
    assert layer.stride(0) == 3 * layer.stride(0) // 3 > layer.shape[1] * layer.stride(1)
    config = {"LAYOUT": layout, "USE_TMA": use_tma}
    if DEVICE == "cpu":
        config |= {"BLOCK_M": 16, "BLOCK_N": 16}
    with poisoned_empty():
        got = tri.mla_decode_launch(q, layer, page_table, seq_lens, 0.1, case.lora, 3, config)
    _check(case, got, expected)
    assert torch.equal(
        ref.mla_decode(q, layer, page_table, seq_lens, 0.1, case.lora)[1], expected[1]
    )


@pytest.mark.parametrize(
    "tokens,lora,rope,page_size",
    [
        pytest.param(7, 32, 16, 4, id="cpu-sized"),
        pytest.param(300, 512, 64, 64, marks=pytest.mark.gpu, id="v3-p64"),
        pytest.param(50, 512, 64, 1, marks=pytest.mark.gpu, id="v3-p1"),
    ],
)
def test_write_kv_fp8_matches_ref(tokens: int, lora: int, rope: int, page_size: int) -> None:
    if DEVICE == "cuda":  # the GPU casts round like torch: random data must match bit for bit
        g = torch.Generator().manual_seed(tokens)
        c_kv, k_pe = (
            torch.randn(tokens, lora, generator=g) * 3,
            torch.randn(tokens, rope, generator=g),
        )
        c_kv[0] = 0.0  # an all-zero row: scale 1
    else:
        c_kv, k_pe = exact_fp8_rows(tokens, lora, rope, seed=tokens)
    row_bytes = fp8_format.row_bytes(lora, rope)
    num_pages = -(-2 * tokens // page_size)
    slots = torch.randperm(num_pages * page_size)[:tokens].to(DEVICE)
    c_kv, k_pe = c_kv.to(DEVICE), k_pe.to(DEVICE)
    cache_ref = torch.full(
        (num_pages, page_size, row_bytes), 0xA5, dtype=torch.uint8, device=DEVICE
    )
    cache = cache_ref.clone()
    ref.write_kv_fp8(cache_ref, slots, c_kv, k_pe)
    tri.write_kv_fp8(cache, slots, c_kv, k_pe)
    used = fp8_format.scale_offset(lora, rope) + 4  # padding bytes are not part of the contract
    diff = (cache[..., :used] != cache_ref[..., :used]).view(-1, used)  # [rows, used bytes]
    if diff.any():
        rows, cols = diff.nonzero(as_tuple=True)
        parts = {"latent": (0, lora), "rope": (lora, lora + 2 * rope), "scale": (used - 4, used)}
        counts = {k: int(diff[:, a:b].sum()) for k, (a, b) in parts.items()}
        r, c = int(rows[0]), int(cols[0])
        flat, flat_ref = cache.view(-1, row_bytes), cache_ref.view(-1, row_bytes)
        pytest.fail(
            f"{int(diff.sum())} bytes differ in {len(set(rows.tolist()))} rows {counts}; first at "
            f"row {r} (slot? {r in slots.tolist()}) byte {c}: got {flat[r, c].item()} want "
            f"{flat_ref[r, c].item()}; row got {flat[r, :used].tolist()} "
            f"want {flat_ref[r, :used].tolist()}"
        )
    deq = ref.dequantize_kv_fp8(cache.view(-1, row_bytes)[slots], lora, rope)
    assert rel_err(deq[:, :lora], c_kv) <= 0.05  # e4m3 keeps 3 mantissa bits
    assert torch.equal(deq[:, lora:], k_pe.to(torch.bfloat16).float())


WRITE_KV_4_ROWS = 4 * num_sms(torch.device(DEVICE)) + 5
"""Past 4 tokens a SM write_kv gives each program 4 rows; 5 more make a ragged last program."""


@pytest.mark.parametrize(
    "tokens,lora,rope,page_size,src,dst",
    [
        pytest.param(7, 32, 16, 4, torch.float32, torch.float32, id="tiny-f32"),
        pytest.param(13, 48, 16, 16, torch.float32, torch.float16, id="odd-lora-f32-to-f16"),
        pytest.param(
            WRITE_KV_4_ROWS, 32, 16, 64, torch.float16, torch.float16, id="4-rows-a-program"
        ),
        pytest.param(
            64, 512, 64, 64, torch.bfloat16, torch.bfloat16, marks=pytest.mark.gpu, id="v3"
        ),
        pytest.param(
            9, 512, 64, 16, torch.float32, torch.bfloat16, marks=pytest.mark.gpu, id="v3-cast"
        ),
    ],
)
def test_write_kv_matches_ref(tokens, lora, rope, page_size, src, dst) -> None:
    """write_kv into one layer of a page-major cache [pages, layers, page_size, L + R], from strided views
    (the latent and rope slices of one projection's output), as the model calls it: the rows at the slots
    hold the cast values, bit for bit as the reference's, and every other row of every layer is
    untouched."""
    g = torch.Generator().manual_seed(tokens + lora)
    kv = torch.randn(tokens, lora + rope + 5, generator=g).to(src).to(DEVICE)
    c_kv, k_pe = kv[:, :lora], kv[:, lora : lora + rope]
    num_pages, layers = -(-2 * tokens // page_size), 3
    slots = torch.randperm(num_pages * page_size, generator=g)[:tokens].to(DEVICE)
    data = torch.randn(num_pages, layers, page_size, lora + rope, generator=g).to(dst).to(DEVICE)
    want = data.clone()
    ref.write_kv(want[:, 1], slots, c_kv, k_pe)
    tri.write_kv(data[:, 1], slots, c_kv, k_pe)
    assert torch.equal(data, want)
    rows = want[:, 1].reshape(-1, lora + rope)[slots]
    assert torch.equal(rows, torch.cat([c_kv, k_pe], dim=1).to(dst))


def test_write_kv_checks() -> None:
    cache = torch.zeros(4, 4, 48, device=DEVICE)
    c_kv, k_pe, slots = (
        torch.zeros(3, 32, device=DEVICE),
        torch.zeros(3, 16, device=DEVICE),
        torch.arange(3),
    )
    slots = slots.to(DEVICE)
    with pytest.raises(ValueError, match="write_kv_fp8 writes the fp8"):
        tri.write_kv(cache.to(torch.uint8), slots, c_kv, k_pe)
    with pytest.raises(ValueError, match="L \\+ R = 40"):
        tri.write_kv(cache, slots, c_kv, k_pe[:, :8])
    with pytest.raises(ValueError, match="slots must be int"):
        tri.write_kv(cache, slots.float(), c_kv, k_pe)
    with pytest.raises(ValueError, match="c_kv \\[T, L\\] and k_pe \\[T, R\\]"):
        tri.write_kv(cache, slots, c_kv, k_pe[:2])


def test_mla_decode_dispatch_and_checks() -> None:
    case = Case((4, 9), 1, 2, 16, torch.float32, lora=32, rope=16)
    q, cache, page_table, seq_lens = _make(case, seed=3)
    with pytest.raises(ValueError, match="kv_cache"):
        tri.mla_decode(q, cache.half(), page_table, seq_lens, 0.1, 32)
    with pytest.raises(ValueError, match="fp8 cache rows"):
        tri.mla_decode(q, torch.zeros(4, 16, 50, dtype=torch.uint8, device=DEVICE), page_table,
                       seq_lens, 0.1, 32)  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        tri.mla_decode(q, cache, page_table, seq_lens, 0.1, 24)
    with pytest.raises(ValueError, match="seq_lens"):
        tri.mla_decode(q, cache, page_table, seq_lens[:1], 0.1, 32)
    with pytest.raises(ValueError, match="page_table"):
        tri.mla_decode(q, cache, page_table.float(), seq_lens, 0.1, 32)
    # the package entry point: the reference on CPU, Triton on CUDA
    out, lse = mla_decode_dispatch(q, cache, page_table, seq_lens, 0.1, 32)
    _check(case, (out, lse), ref.mla_decode(q, cache, page_table, seq_lens, 0.1, 32))


@pytest.mark.parametrize(
    "num_heads,num_q", [(4, 1), (8, 2), pytest.param(16, 2, marks=gpu_sweep)]
)  # (16, 2): (8, 2)'s kernels over two programs of query rows
def test_batch_invariant_mode_cuts_by_request(num_heads: int, num_q: int) -> None:
    """In batch-invariant mode a request's output and lse are bit-for-bit the same alone or in a
    batch, whatever the page-table width (the split grid), and still match the reference."""
    torch.manual_seed(num_heads)
    lora, rope, page = 64, 16, 16
    lens = torch.tensor([2, 17, 70, 33, 100], dtype=torch.int32, device=DEVICE)
    batch, width = lens.numel(), 8
    kv = torch.randn(batch * width + 3, page, lora + rope, device=DEVICE)
    table = torch.randperm(batch * width + 3, device=DEVICE)[: batch * width]
    table = table.view(batch, width).to(torch.int32)
    q = torch.randn(batch, num_q, num_heads, lora + rope, device=DEVICE)
    with use_batch_invariant():
        out, lse = tri.mla_decode(q, kv, table, lens, 0.125, lora)
        for idx in ([1], [2, 0], [4, 3, 1]):
            i = torch.tensor(idx, device=DEVICE)
            for t in (table[i], torch.cat([table[i], table[i]], 1), table[i][:, :7]):
                o, s = tri.mla_decode(q[i], kv, t, lens[i], 0.125, lora)
                assert torch.equal(o, out[i]) and torch.equal(s, lse[i]), (idx, t.shape)
    want, want_lse = ref.mla_decode(q, kv, table, lens, 0.125, lora)
    assert rel_err(out, want) < 1e-5 and rel_err(lse, want_lse) < 1e-5
