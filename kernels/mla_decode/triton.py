"""MLA decode attention (absorbed, paged latent cache, split-KV) and the fp8 cache writer: the
launchers of the Triton kernels in `_kernels.py`. Same contracts as `ref.py`.

`mla_decode` runs in one or two launches: a split kernel, in which program (m-block, split,
request) attends BLOCK_M of the request's Q * H query rows to one chunk of its cache positions;
then, with more than one split, the combine kernel, which merges the splits' normalised outputs
through their log-sum-exps. The split kernel comes in two layouts of the same math: `heads_major`
(query rows are the MMA's M: many rows, 128 heads) and `kv_major` (cache positions are the MMA's M:
keeps the tensor-core tiles full with few rows, 16 heads).

The split count is picked on the host, with no device sync, from the batch, the m-blocks, the
longest possible sequence (page_table columns * page_size) and the number of SMs, to fill the GPU
in few, full waves; each request then cuts its own length into that many chunks (so short
requests get short chunks). Launch configs (layout, BLOCK_M/N, warps, stages, TMA, split policy)
come from `tuning` under the key "<cache dtype>,m<16|32|64>" (query rows per request, capped).
The m-block is the fastest grid axis, so the programs that read the same chunk for different heads
run together and the second read of a chunk comes from L2. On Hopper, heads_major configs with
`gluon` run the split step on the Gluon kernel of `gluon_sm90.py` where it applies (16-bit cache,
or fp8 under a bf16 q; tiles within pages): same grid and outputs, explicit warp layouts.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tuning
from .._backend import batch_invariant, num_sms
from ..kv_cache_checks import (
    check_fp8_cache,
    check_kv_dims,
    float_cache_inputs,
    fp8_cache_inputs,
)
from ..kv_row_fp8 import FP8_E4M3_MAX
from . import _kernels, gluon_sm90

LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)
_CACHE_NAMES = {
    torch.uint8: "fp8",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}

_SPLIT_KERNELS = {
    "heads_major": _kernels.split_heads_major_kernel,
    "kv_major": _kernels.split_kv_major_kernel,
}
_SPLIT_POLICY = {
    "CTAS_PER_SM": 1,
    "MAX_SPLITS": 128,
    "MIN_TILES_PER_SPLIT": 2,
    "SPLIT_OVERHEAD_TILES": 2,
    "INVARIANT_SPLIT_TOKENS": 512,  # batch-invariant mode: cache positions per split
    # the combine's tiles (see combine_tiles): a small batch with a long cache cut into many
    # splits makes few rows to combine; several programs an SM, each reading many elements at
    # once, keep the SMs busy where one program per 128 latent dims left most of them idle
    "COMBINE_PROGRAMS_PER_SM": 4,
    "COMBINE_TILE": 4096,
    "COMBINE_MAX_D": 512,
}
# Key: "<cache dtype>,m<16|32|64>" by the request's query rows Q * H (m64: 64 or more). LAYOUT picks
# the split kernel; BLOCK_M is the query rows per program, BLOCK_N the cache positions per tile.
# Chosen by benchmarks/tune_mla_decode.py's sweep: kv_major with TMA for 16-32 query rows (cache
# positions are the MMA's M side, so the tensor-core tiles stay full with few query rows);
# heads_major with TMA for 64+ rows (the query rows fill the tile themselves). fp8 caches:
# heads_major, whose MMA operands tolerate the in-register fp8 -> bf16 conversion best (kv_major
# spilled heavily). gluon: 64+ rows on a 16-bit cache take the Gluon split kernel on sm_90, well
# ahead of the tl.dot kernel at 128 heads; gluon_stages: its ring of cache tiles. On an fp8 cache
# (under a bf16 q) the Gluon kernel converts each tile's latent to bf16 in place, again well ahead
# of the tl.dot kernel; 64-position tiles beat 32-position ones there.
# FP8_ASM (default on): under a bf16 q on a GPU the Triton kernels convert fp8 rows by the exact
# integer conversion (_kernels.E4M3_TO_BF16_PTX) instead of Triton's casts, which is faster.
_BF16_M16 = {"LAYOUT": "kv_major", "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
             "USE_TMA": True}  # fmt: skip
_BF16_M32 = {"LAYOUT": "kv_major", "BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
             "USE_TMA": True}  # fmt: skip
_BF16_M64 = {"LAYOUT": "heads_major", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8,
             "num_stages": 2, "USE_TMA": True, "gluon": True, "gluon_stages": 2}  # fmt: skip
_FP8_M16 = {"LAYOUT": "heads_major", "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4,
            "num_stages": 2, "USE_TMA": False, "CTAS_PER_SM": 2}  # fmt: skip
_FP8_M64 = {"LAYOUT": "heads_major", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8,
            "num_stages": 2, "USE_TMA": True, "gluon": True, "gluon_stages": 2}  # fmt: skip
tuning.register(
    "mla_decode",
    "any",
    {"default": {"LAYOUT": "heads_major", "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4,
                 "num_stages": 1, **_SPLIT_POLICY, "INVARIANT_SPLIT_TOKENS": 32}},
)  # fmt: skip
tuning.register(
    "mla_decode",
    "sm90",
    {
        "default": {**_BF16_M16, **_SPLIT_POLICY},
        "bf16,m16": {**_BF16_M16, **_SPLIT_POLICY},
        "bf16,m32": {**_BF16_M32, **_SPLIT_POLICY},
        "bf16,m64": {**_BF16_M64, **_SPLIT_POLICY},
        "fp16,m64": {**_BF16_M64, **_SPLIT_POLICY},
        "fp8,m16": {**_SPLIT_POLICY, **_FP8_M16},
        "fp8,m32": {**_SPLIT_POLICY, **_FP8_M16},
        "fp8,m64": {**_FP8_M64, **_SPLIT_POLICY},
    },
)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Q, H, Dk]; kv_cache: [num_pages, page_size, Dk] in q's dtype, or uint8 fp8 rows;
    page_table: [B, max_pages] int; seq_lens: [B] int. Returns out [B, Q, H, kv_lora_rank] (q's
    dtype), lse [B, Q, H] fp32."""
    return mla_decode_launch(q, kv_cache, page_table, seq_lens, softmax_scale, kv_lora_rank)


def mla_decode_launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` with the split count forced (None: the policy's choice) and entries of the tuned
    launch config overridden by `config`. For tests, benchmarks and tuning sweeps."""
    _check(q, kv_cache, page_table, seq_lens, kv_lora_rank)
    if not softmax_scale > 0:
        raise ValueError(f"mla_decode: softmax_scale={softmax_scale} must be > 0")
    batch, num_q, num_heads, head_dim = q.shape
    rope_dim = head_dim - kv_lora_rank
    num_rows = num_q * num_heads
    out = torch.empty(batch, num_q, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0 or num_rows == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    is_fp8 = kv_cache.dtype == torch.uint8
    row_class = min(64, max(16, triton.next_power_of_2(num_rows)))
    cfg = tuning.lookup("mla_decode", f"{_CACHE_NAMES[kv_cache.dtype]},m{row_class}", q.device)
    if config is not None:
        cfg = {**cfg, **config}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_stages = cfg["num_stages"]
    if (
        cfg["LAYOUT"] == "kv_major"
        and kv_cache.dtype in (torch.bfloat16, torch.float16)
        and q.is_cuda
    ):
        # Triton 3.6, sm_90: without pipelining (1 stage) the kv_major kernel's bf16 tile goes
        # registers -> shared memory -> transposed wgmma operand, and the results came out wrong;
        # pipelined, the tile lands in shared memory by async copy.
        num_stages = max(num_stages, 2)
    m_blocks = triton.cdiv(num_rows, block_m)
    page_size = kv_cache.shape[1]
    split_tokens = 0
    invariant = batch_invariant() and num_splits is None
    if invariant:
        # chunks of a fixed length, so that a request's arithmetic does not follow the batch
        split_tokens = triton.cdiv(cfg["INVARIANT_SPLIT_TOKENS"], block_n) * block_n
        num_splits = triton.cdiv(max(page_table.shape[1] * page_size, 1), split_tokens)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, m_blocks, page_table.shape[1] * page_size, block_n, cfg, num_sms(q.device)
        )
    if num_splits < 1:
        raise ValueError(f"mla_decode: num_splits={num_splits} must be >= 1")

    if is_fp8:
        kv8, kv16, kv32 = kv_cache, kv_cache.view(torch.bfloat16), kv_cache.view(torch.float32)
    else:
        kv8 = kv16 = kv32 = kv_cache
    if num_splits == 1 and not invariant:
        part, part_lse = out, lse
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), 0, lse.stride(1), lse.stride(2))
    else:
        part = torch.empty(
            batch, num_splits, num_q, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            batch, num_splits, num_q, num_heads, dtype=torch.float32, device=q.device
        )
        o_strides = part.stride()[:4]
        l_strides = part_lse.stride()
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rows = tile_rows(kv_cache, block_n)
    if (
        cfg["LAYOUT"] == "heads_major"
        and rows is not None
        and gluon_sm90.usable(q, kv_cache, kv_lora_rank, cfg)
    ):
        gluon_sm90.launch(
            q if q.is_contiguous() else q.contiguous(), kv_cache, rows, page_table, seq_lens,
            part, part_lse, o_strides, l_strides, num_splits, split_tokens,
            softmax_scale * LOG2E, kv_lora_rank, cfg,
        )  # fmt: skip
    else:
        use_tma = cfg.get("USE_TMA") and rows is not None
        kv_desc, pe_desc = _descriptors(kv_cache, kv_lora_rank, rope_dim, block_n, rows, use_tma)
        _SPLIT_KERNELS[cfg["LAYOUT"]][(m_blocks, num_splits, batch)](
            q, kv8, kv16, kv32, kv_desc, pe_desc, page_table, seq_lens, part, part_lse,
            num_heads, num_rows, num_splits, split_tokens, softmax_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            page_table.stride(0),
            *o_strides, *l_strides,
            NUM_Q=num_q, PAGE_SIZE=page_size,
            D_LATENT=kv_lora_rank, D_ROPE=rope_dim, KV_FP8=_fp8_mode(q, is_fp8, cfg),
            BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision,
            USE_TMA=kv_desc is not None, num_warps=cfg["num_warps"], num_stages=num_stages,
        )  # fmt: skip
    if invariant:
        block_d = min(128, kv_lora_rank)
        _kernels.combine_invariant_kernel[(num_rows, batch, kv_lora_rank // block_d)](
            part, part_lse, seq_lens, out, lse,
            num_heads, num_rows, num_splits, split_tokens,
            *out.stride()[:3], *lse.stride(),
            D_LATENT=kv_lora_rank, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    elif num_splits > 1:
        splits_p2 = triton.next_power_of_2(num_splits)
        block_d, chunk = combine_tiles(
            batch * num_rows, splits_p2, kv_lora_rank, cfg, num_sms(q.device)
        )
        _kernels.combine_kernel[(num_rows, batch, kv_lora_rank // block_d)](
            part, part_lse, out, lse,
            num_heads, num_rows, num_splits,
            *out.stride()[:3], *lse.stride(),
            D_LATENT=kv_lora_rank, BLOCK_D=block_d, SPLITS_P2=splits_p2,
            SPLIT_CHUNK=chunk, num_warps=4,
        )  # fmt: skip
    return out, lse


def _fp8_mode(q: torch.Tensor, is_fp8: bool, cfg: dict) -> int:
    """The split kernels' KV_FP8: 0 for a float cache; on an fp8 cache, the exact integer conversion
    (_kernels.E4M3_TO_BF16_PTX) under a bf16 q on a GPU unless the config sets FP8_ASM False, else
    Triton's casts."""
    if not is_fp8:
        return 0
    asm = q.dtype == torch.bfloat16 and q.is_cuda and cfg.get("FP8_ASM", True)
    return (_kernels.FP8_ASM if asm else _kernels.FP8_CVT).value


def write_kv_fp8(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Quantizes T tokens' [c_kv | k_pe] into an fp8 cache [num_pages, page_size, row_bytes] uint8
    at flat slots (page * page_size + row), in place. Padding bytes of a row are left as they
    are."""
    c_kv = fp8_cache_inputs(kv_cache, slots, c_kv, k_pe, "write_kv_fp8")
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    lora, rope = c_kv.shape[1], k_pe.shape[1]
    if c_kv.shape[0] == 0:
        return
    _kernels.write_kv_fp8_kernel[(c_kv.shape[0],)](
        c_kv, k_pe, slots, kv_cache, kv_cache.view(torch.bfloat16), kv_cache.view(torch.float32),
        c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], D_LATENT=lora, D_ROPE=rope, FP8_MAX=FP8_E4M3_MAX,
        num_warps=4 if lora >= 512 else 1,
    )  # fmt: skip


def write_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Stores T tokens' [c_kv | k_pe] in a float cache [num_pages, page_size, L + R] at flat slots,
    in place (see ref.write_kv): one launch, a few tokens a program."""
    c_kv, k_pe = float_cache_inputs(kv_cache, slots, c_kv, k_pe, "write_kv")
    lora, rope = c_kv.shape[1], k_pe.shape[1]
    num_tokens = c_kv.shape[0]
    if num_tokens == 0:
        return
    rows = 1 if num_tokens <= 4 * num_sms(kv_cache.device) else 4
    _kernels.write_kv_kernel[(triton.cdiv(num_tokens, rows),)](
        c_kv, k_pe, slots, kv_cache, num_tokens,
        c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], D_LATENT=lora, D_ROPE=rope,
        BLOCK_L=triton.next_power_of_2(lora), BLOCK_R=triton.next_power_of_2(rope), ROWS=rows,
        num_warps=2 if lora >= 256 else 1,
    )  # fmt: skip


def tile_rows(kv_cache: torch.Tensor, block_n: int) -> int | None:
    """The rows a TMA descriptor over the cache spans, from the first page's first row to the last
    page's end (pages may lie apart: a layer of a page-major cache), when every full tile of
    block_n positions lies in one page; else None."""
    num_pages, page_size, _ = kv_cache.shape
    stride_page, stride_row = kv_cache.stride(0), kv_cache.stride(1)
    if page_size % block_n or stride_page % stride_row or stride_page < page_size * stride_row:
        return None
    return (num_pages - 1) * (stride_page // stride_row) + page_size


def _descriptors(
    kv_cache: torch.Tensor, lora: int, rope: int, block_n: int, rows: int | None, use_tma: bool
) -> tuple[TensorDescriptor | None, TensorDescriptor | None]:
    """TMA descriptors over the cache's `rows` (`tile_rows`; latent, rope) when `use_tma`; else
    (None, None)."""
    if not use_tma:
        return None, None
    width, stride_row = kv_cache.shape[2], kv_cache.stride(1)
    if kv_cache.dtype == torch.uint8:
        pe_view = kv_cache.view(torch.bfloat16)
        kv_desc = TensorDescriptor(kv_cache, [rows, width], [stride_row, 1], [block_n, lora])
        pe_desc = TensorDescriptor(
            pe_view, [rows, width // 2], [stride_row // 2, 1], [block_n, rope]
        )
    else:
        kv_desc = TensorDescriptor(kv_cache, [rows, width], [stride_row, 1], [block_n, lora])
        pe_desc = TensorDescriptor(kv_cache, [rows, width], [stride_row, 1], [block_n, rope])
    return kv_desc, pe_desc


def choose_num_splits(
    batch: int, m_blocks: int, max_seq_len: int, block_n: int, cfg: dict, num_sms: int
) -> int:
    """Splits per request, by a cost model in units of one tile's time: waves of programs times
    (tiles per split + SPLIT_OVERHEAD_TILES, a program's fixed cost), plus that overhead once more
    for the combine step when splitting. Fewest splits on ties; at least MIN_TILES_PER_SPLIT tiles
    per split of the longest request, except while the programs fill at most half the SMs: there
    one tile a split is allowed (with 128 heads at batch 1 and a short context, more one-tile
    splits won; once the programs filled more of the GPU, they lost). Cached: it runs on every
    decode step."""
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    policy = (cfg["MAX_SPLITS"], cfg["MIN_TILES_PER_SPLIT"], cfg["CTAS_PER_SM"])
    return _num_splits(batch * m_blocks, tiles, num_sms, *policy, cfg["SPLIT_OVERHEAD_TILES"])


def combine_tiles(rows: int, splits_p2: int, lora: int, cfg: dict, num_sms: int) -> tuple[int, int]:
    """(BLOCK_D, SPLIT_CHUNK) of the combine for `rows` query rows over the whole batch: latent
    blocks of COMBINE_MAX_D dims, halved (down to 16) until the programs reach COMBINE_PROGRAMS_PER_SM
    per SM (a few rows of a long cache, cut into many splits, would otherwise leave most SMs idle
    while each program walks its splits), and chunks of about COMBINE_TILE elements read at once.
    Many rows take the whole latent a program: cut into 128-dim blocks, they made thousands of
    programs of a few KB each, several times slower than fewer programs reading the same bytes."""
    block_d = min(cfg["COMBINE_MAX_D"], lora)
    while block_d > 16 and rows * (lora // block_d) < cfg["COMBINE_PROGRAMS_PER_SM"] * num_sms:
        block_d //= 2
    return block_d, max(1, min(splits_p2, cfg["COMBINE_TILE"] // block_d))


@functools.lru_cache(maxsize=4096)
def _num_splits(
    programs: int, tiles: int, num_sms: int, max_splits: int, min_tiles: int, ctas_per_sm: int,
    overhead: int,
) -> int:  # fmt: skip
    slots = num_sms * ctas_per_sm
    short = max(1, min(max_splits, tiles // min_tiles))
    few = [s for s in range(short + 1, min(max_splits, tiles) + 1) if 2 * programs * s <= slots]

    def cost(s: int) -> int:
        waves = -(-programs * s // slots)
        return waves * (-(-tiles // s) + overhead) + (overhead if s > 1 else 0)

    return min([*range(1, short + 1), *few], key=lambda s: (cost(s), s))


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    if q.dim() != 4 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"mla_decode: q must be float [B, Q, H, Dk], got {q.dtype} {tuple(q.shape)}"
        )
    batch, _, _, head_dim = q.shape
    check_kv_dims(kv_lora_rank, head_dim - kv_lora_rank, "mla_decode")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"mla_decode: kv_cache must be [P, page_size, D], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype == torch.uint8:
        check_fp8_cache(kv_cache, kv_lora_rank, head_dim - kv_lora_rank, "mla_decode")
    elif kv_cache.dtype != q.dtype or kv_cache.shape[-1] != head_dim or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"mla_decode: kv_cache must be {q.dtype} [P, page_size, {head_dim}], unit stride last "
            f"(or uint8 fp8 rows), got {kv_cache.dtype} {tuple(kv_cache.shape)} {kv_cache.stride()}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype not in _INT_DTYPES:
        raise ValueError(
            f"mla_decode: page_table must be int [{batch}, max_pages], got {page_table.dtype} "
            f"{tuple(page_table.shape)}"
        )
    if seq_lens.shape != (batch,) or seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"mla_decode: seq_lens must be int [{batch}], got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    for name, t in (("kv_cache", kv_cache), ("page_table", page_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"mla_decode: {name} on {t.device}, q on {q.device}")
