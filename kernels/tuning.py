"""Tuned launch configurations, per (op, shape class, device): the one place launchers look them up.

Each op registers a table mapping a shape-class key to a config dict (BLOCK_* sizes, num_warps, num_stages, ...).
`lookup(op, key, device)` returns the entry for the device's architecture family when one exists, else the op's
default. Keys are strings built by the op's launcher from the problem shape (e.g. "heads=16,dk=576").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._backend import capability

# op -> arch ("sm90", "sm100", "any") -> shape-class key ("default" always present) -> config
_TABLES: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}


def register(op: str, arch: str, table: dict[str, dict[str, Any]]) -> None:
    _TABLES.setdefault(op, {})[arch] = table


@functools.cache
def device_arch(device_index: int | None) -> str:
    if device_index is None or not torch.cuda.is_available():
        return "cpu"
    major, minor = capability(device_index)
    return f"sm{major}{minor}"


def _arch(device: torch.device) -> str:
    index = None
    if device.type == "cuda":  # torch.device("cuda") names the current device
        index = device.index if device.index is not None else torch.cuda.current_device()
    return device_arch(index)


def find(op: str, key: str, device: torch.device) -> dict[str, Any] | None:
    """The entry for `op` at exactly `key` on `device` (its architecture's table, then "any"), or None."""
    tables = _TABLES.get(op, {})
    for candidate in (_arch(device), "any"):
        table = tables.get(candidate, {})
        if key in table:
            return table[key]
    return None


def lookup(op: str, key: str, device: torch.device) -> dict[str, Any]:
    """The tuned config for `op` at shape class `key` on `device`, falling back to the op's defaults."""
    found = find(op, key, device)
    if found is None:
        found = find(op, "default", device)
    if found is None:
        raise KeyError(f"no tuning entry for op {op!r} (key {key!r}, arch {_arch(device)})")
    return found


# ---- fp8_gemm, quantize_act, fused_moe (kernels/fp8_gemm, kernels/fused_moe) ---------------------
# "any": small tiles that keep the CPU interpreter quick; "sm90": tuned on Hopper for DeepSeek-V3's
# projections at decode and prompt sizes (each choice's reason beside it).
# fp8_gemm keys "m<=1|16|32|64|128", "m>128", "invariant-<phase>" (batch-invariant mode), and
# "<m class>,n=N,k=K" for one weight shape (taken before its class's entry, outside batch-invariant mode).
# gemv: the CUDA-core kernel of fp8_gemm/gemv.py: BLOCK_N weight rows (dividing 128) by GROUPS
# groups of 128 along K per loop step; past max_m rows or max_k the key `otherwise` is used.
# pdl (gemv, gluon_decode): launch with programmatic dependent launch where `_backend.pdl_enabled`.
# fuse_quant: quantize the activation inside the GEMM (fuse_max_work: only while the blocks of
# weight rows quantize at most this many activation elements between them; see triton.py).
# split_k_target_ctas / min_k_tiles: split K until tiles * splits reaches the target, each split
# keeping at least min_k_tiles k-tiles of 128; one_wave: at most the target instead (set it to the
# CTAs the GPU holds at once: m<=16 on Hopper, 132 SMs x 3 by shared memory).
# gluon_decode: where set (sm90), calls with min_m <= M <= 64 and K >= min_k run the Gluon decode
# kernel (fp8_gemm/gluon_decode_sm90.py: BLOCK_N, num_stages cut by run_per_slot / min_stages,
# whole_tiles_fill, pdl) and the other keys
# serve the tl.dot kernel wherever that one cannot run.
# fused_moe keys "<bf16|fp8>,rows<=8|16|64|256" or ",rows>256" (mean rows per expert), or
# ",invariant-<prefill|decode>" (batch-invariant mode);
# *1 = gate/up GEMM, *2 = down GEMM; fp8 needs BLOCK_N1 == BLOCK_K1 == BLOCK_K2 == 128.
_FP8_GEMM_ANY = {
    "BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 2,
    "fuse_quant": False, "split_k_target_ctas": 0, "min_k_tiles": 1,
}  # fmt: skip


def _gemv_cfg(bn: int, groups: int, warps: int, split: int, min_k: int = 4, **extra: Any):
    """extra: max_k (default: any K)."""
    return {"gemv": True, "max_m": 1, "otherwise": "m<=16", "fuse_quant": True, "BLOCK_N": bn,
            "GROUPS": groups, "num_warps": warps, "num_stages": 1, "split_k_target_ctas": split,
            "min_k_tiles": min_k, **extra}  # fmt: skip


register("quantize_act", "any", {"default": {"BLOCK_M": 32, "num_warps": 4}})
register(
    "fp8_gemm",
    "any",
    {
        "default": _FP8_GEMM_ANY,
        "m<=1": _gemv_cfg(32, 2, 4, 8, min_k=1),
        "m<=16": {
            **_FP8_GEMM_ANY,
            "BLOCK_M": 16,
            "fuse_quant": True,
            "split_k_target_ctas": 8,
            "swap_ab": True,
        },
    },
)
_FUSED_MOE_ANY = {
    "BLOCK_M": 16, "GROUP_M": 4,
    "BLOCK_N1": 32, "BLOCK_K1": 32, "warps1": 4, "stages1": 2,
    "BLOCK_N2": 32, "BLOCK_K2": 32, "warps2": 4, "stages2": 2,
}  # fmt: skip
_FUSED_MOE_ANY_FP8 = {**_FUSED_MOE_ANY, "BLOCK_N1": 128, "BLOCK_K1": 128, "BLOCK_K2": 128}
_ROW_CLASSES = ("rows<=8", "rows<=16", "rows<=64", "rows<=256", "rows>256")
register(
    "fused_moe",
    "any",
    {"default": _FUSED_MOE_ANY, **{f"fp8,{rows}": _FUSED_MOE_ANY_FP8 for rows in _ROW_CLASSES}},
)


def _gemm_cfg(
    bm: int, bn: int, warps: int, stages: int, fuse: bool, split: int, **extra: Any
) -> dict[str, Any]:
    """extra: GROUP_M (default 8), tma, lag, warp_specialize, swap_ab, one_wave (see fp8_gemm/triton.py);
    gluon: the Gluon kernel of fp8_gemm/gluon_sm90.py where it runs (Hopper), else tma."""
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
            "fuse_quant": fuse, "split_k_target_ctas": split, "min_k_tiles": 4,
            **extra}  # fmt: skip


def _moe_cfg(bm: int, gate_up: tuple, down: tuple, group_m: int = 8) -> dict[str, Any]:
    """gate_up / down: (BLOCK_N, BLOCK_K, num_warps, num_stages). Optional keys added by callers:
    tma (weights through TMA descriptors), permute_a (x laid out by row, read through TMA),
    tma_act (the down GEMM reads the activation through TMA), prequant (fp8: quantize x once per
    token, then permute the fp8 rows), gluon / gluon_stages / gluon_down (fp8: the Gluon kernels of
    fused_moe/gluon_sm90.py on Hopper; gluon_down False keeps the tl.dot down GEMM)."""
    n1, k1, w1, s1 = gate_up
    n2, k2, w2, s2 = down
    return {"BLOCK_M": bm, "GROUP_M": group_m, "BLOCK_N1": n1, "BLOCK_K1": k1, "warps1": w1,
            "stages1": s1, "BLOCK_N2": n2, "BLOCK_K2": k2, "warps2": w2, "stages2": s2}  # fmt: skip


register("quantize_act", "sm90", {"default": {"BLOCK_M": 16, "num_warps": 4}})
# pdl: programmatic dependent launch where `_backend.pdl_enabled` (the kernel loads its first weight
# tiles while the kernel before it finishes), which shortens each call of a decode step's chain of
# GEMMs (q_b, shared_w2); shared_w13 was slower so while it quantized inside, and gains on fp8 input
# with its own entry below
_GEMV_SM90 = _gemv_cfg(16, 4, 4, 528, max_k=8192, fuse_max_work=4_000_000, pdl=True)
_FP8_GEMM_LARGE = _gemm_cfg(128, 128, 8, 4, False, 0, GROUP_M=16, tma=True, gluon=True)
# The Gluon decode kernel (fp8_gemm/gluon_decode_sm90.py) for M = min_m-64, K >= min_k on Hopper; the
# entry's other keys serve the tl.dot kernel elsewhere. 64 weight rows a tile, 12 ring slots, one
# whole n-tile a CTA where the n-tiles fill most of the SMs (whole_tiles_fill), else stream-K. At
# M = 64 it beat the tl.dot kernel on every projection with K >= 2048 (o, mlp_w2, mlp_w13,
# shared_w13, qkv_a, shared_w2), since it keeps more of the weight's loads in flight; it was slower
# for q_b (K = 1536) and kv_b (K = 512), hence min_k, and for mlp_w13 at M <= 16. Whole n-tiles,
# several a CTA, wherever they fill the SMs (`plan`), and PDL gained mlp_w13 more.
# min_m 2: at M = 1 the gemv / swapped MMA entries stay (o through "otherwise" quantizes inside the
# swapped kernel, which beats a separate quantization followed by this kernel).
# The ring is cut to a quarter of a CTA's run (`ring_slots`, at least 4 slots): the short runs of
# qkv_a, shared_w2 and shared_w13 gain so at M = 4-64; o, mlp_w2, mlp_w13 (runs of 128+) are
# unchanged.
# At M <= 16 the output is stored straight from the MMA's registers (direct_max_m), a small gain
# for o and for q_b's 192-row tiles; at M = 64 it was slower (kv_b).
_GLUON_DECODE = {
    "BLOCK_N": 64, "num_stages": 12, "run_per_slot": 4, "min_stages": 4, "whole_tiles_fill": 0.8,
    "min_k": 2048, "min_m": 2, "pdl": True, "direct_max_m": 16,
}  # fmt: skip
# q_b (K = 1536) and kv_b (K = 512): 128 weight rows a tile, whole n-tiles on 96 / 128 CTAs, 6 slots.
# Ahead of the tl.dot entries for q_b at every M from 4 to 64 and for kv_b at M = 32 (at M <= 16
# kv_b keeps its tl.dot entry, which is faster there)
_GLUON_DECODE_WIDE = {
    **_GLUON_DECODE, "BLOCK_N": 128, "num_stages": 6, "whole_tiles_fill": 0.7, "min_k": 512,
}  # fmt: skip
# q_b: tiles of 3 boxes of 64 rows (192), one a CTA on 128 CTAs (96 with 128-row tiles, and a CTA's
# own streaming rate is bounded, so more CTAs read the weight faster), 6 slots; ahead of 128-row
# tiles at every M from 2 to 64.
_GLUON_DECODE_192 = {**_GLUON_DECODE_WIDE, "BLOCK_N": 64, "boxes": 3, "min_stages": 6}


def _decode(cfg: dict[str, Any], gluon: dict[str, Any] = _GLUON_DECODE) -> dict[str, Any]:
    return {**cfg, "gluon_decode": gluon}


_FP8_GEMM_M16 = _gemm_cfg(16, 128, 4, 3, True, 396, swap_ab=True, one_wave=True)
_FP8_GEMM_M32 = _gemm_cfg(32, 64, 4, 4, True, 264)
_FP8_GEMM_M64 = _gemm_cfg(64, 64, 4, 4, False, 264, min_k_tiles=6)
register(
    "fp8_gemm",
    "sm90",
    {
        # M = 1: the CUDA-core kernel up to K = 8192 (q_a, q_b, kv_a, mlp_w1); past it (o, mlp_w2)
        # the MMA entry is faster
        # fuse_max_work: quantize x beforehand past 4M elements of redundant in-kernel quantization
        # (mlp_w1 gains so; q_b, 2.4M, stays fused: there the extra launch costs more than it saves)
        "m<=1": _GEMV_SM90,
        "m<=16": _decode(_FP8_GEMM_M16),
        "m<=32": _decode(_FP8_GEMM_M32),
        # min_k_tiles 6: shared_w2 (K = 2048, 16 k-tiles) splits 2 ways, not 3, which is faster; the
        # other decode shapes are unchanged
        "m<=64": _decode(_FP8_GEMM_M64),
        "m<=128": _gemm_cfg(64, 128, 4, 4, False, 132),
        # Per-shape entries ("<class>,n=N,k=K"; fp8_gemm/triton.py's _gemm_config) for DeepSeek-V3's
        # projections whose best config differs from their class's, the way vLLM keys its block-fp8
        # configs by N and K. Each beat its class entry in a CUDA graph of 8 calls on distinct
        # weights, the way a decode step runs them.
        # q_b at M = 1: 32 weight rows a program
        "m<=1,n=24576,k=1536": {**_GEMV_SM90, "BLOCK_N": 32},
        # mlp_w13 (w1 | w3) at M = 1: 32 rows, two groups of 128 a step
        "m<=1,n=36864,k=7168": {**_GEMV_SM90, "BLOCK_N": 32, "GROUPS": 2},
        # qkv_a (q_a | kv_a) at M = 1: 8 rows, eight groups of 128 a step, K split toward 1056
        # programs; PDL gains it more
        "m<=1,n=2112,k=7168": {
            **_GEMV_SM90,
            "BLOCK_N": 8,
            "GROUPS": 8,
            "split_k_target_ctas": 1056,
            "min_k_tiles": 2,
        },
        # kv_b at M = 1 (K = 512, quantized inside): 32 rows, two groups a step (with PDL)
        "m<=1,n=32768,k=512": {**_GEMV_SM90, "BLOCK_N": 32, "GROUPS": 2},
        # shared_w2 at M = 1 (K = 2048): 8 rows, eight groups of 128 a step (896 programs, no split)
        "m<=1,n=7168,k=2048": {**_GEMV_SM90, "BLOCK_N": 8, "GROUPS": 8, "split_k_target_ctas": 264},
        # shared_w13 at M = 1, on fp8 input from ffn_norm: 32 rows, four groups of
        # 128 a step, PDL (which gains here, while it made the class default slower on this shape)
        "m<=1,n=4096,k=7168": {**_GEMV_SM90, "BLOCK_N": 32, "GROUPS": 4},
        # o and mlp_w2 at M = 64, for the tl.dot kernel where the Gluon decode kernel cannot run: 3
        # stages (4 CTAs an SM), a small gain; mlp_w13 is slower so and keeps its class entry
        "m<=64,n=7168,k=16384": _decode(_gemm_cfg(64, 64, 4, 3, False, 264, min_k_tiles=6)),
        "m<=64,n=7168,k=18432": _decode(_gemm_cfg(64, 64, 4, 3, False, 264, min_k_tiles=6)),
        # qkv_a and shared_w2 at M = 64 (tl.dot, as above): 32 weight rows a CTA (twice the output
        # tiles, fewer splits of K), faster for both
        "m<=64,n=2112,k=7168": _decode(_gemm_cfg(64, 32, 4, 4, False, 264, min_k_tiles=6)),
        "m<=64,n=7168,k=2048": _decode(_gemm_cfg(64, 32, 4, 4, False, 264, min_k_tiles=12)),
        # mlp_w13 at M <= 16: the swapped tl.dot kernel, faster here than the Gluon decode kernel
        "m<=16,n=36864,k=7168": _FP8_GEMM_M16,
        # q_b at M = 2-64 on the Gluon decode kernel with 192-row tiles (_GLUON_DECODE_192), kv_b at
        # M = 17-64 with 128-row tiles (_GLUON_DECODE_WIDE)
        "m<=16,n=24576,k=1536": _decode(_FP8_GEMM_M16, _GLUON_DECODE_192),
        "m<=32,n=24576,k=1536": _decode(_FP8_GEMM_M32, _GLUON_DECODE_192),
        "m<=64,n=24576,k=1536": _decode(_FP8_GEMM_M64, _GLUON_DECODE_192),
        "m<=32,n=32768,k=512": _decode(_FP8_GEMM_M32, _GLUON_DECODE_WIDE),
        # kv_b at M = 64 (a short prompt's prefill; K = 512): the Gluon kernel, slightly ahead; its
        # tl.dot config (where Gluon cannot run) has 3 stages, so its 512 CTAs fit in one wave (with
        # 4 stages they took two)
        "m<=64,n=32768,k=512": _decode(_gemm_cfg(64, 64, 4, 3, False, 0), _GLUON_DECODE_WIDE),
        "default": _FP8_GEMM_LARGE,
        # batch-invariant mode, by forward phase: no split of K
        "invariant-decode": _gemm_cfg(64, 64, 4, 4, False, 0),
        "invariant-prefill": _FP8_GEMM_LARGE,
    },
)
# The bf16 / fp8 configs for decode-size batches and for prompts; batch-invariant mode takes them by
# forward phase for every batch.
_MOE_BF16_DECODE = _moe_cfg(32, (64, 128, 4, 4), (64, 128, 4, 4))
_MOE_BF16_PREFILL = {
    **_moe_cfg(128, (128, 64, 8, 3), (256, 64, 8, 3)),
    "tma": True,
    "permute_a": True,
}
_MOE_FP8_DECODE = _moe_cfg(32, (128, 128, 4, 4), (64, 128, 4, 4))
_MOE_FP8_PREFILL = {
    **_moe_cfg(128, (128, 128, 8, 3), (128, 128, 8, 4)),
    "tma": True,
    "permute_a": True,
    "tma_act": True,
    "prequant": True,
    "gluon": True,  # fused_moe/gluon_sm90.py where it runs (Hopper); the keys above elsewhere
    "gluon_stages": (4, 5),
}
register(
    "fused_moe",
    "sm90",
    {
        # up to 8 rows an expert: as fp8 below, and ahead of the wider tiles at T = 1-16 here too
        "bf16,rows<=8": {**_moe_cfg(16, (64, 128, 4, 3), (64, 128, 4, 3)), "tma": True},
        "bf16,rows<=16": _MOE_BF16_DECODE,
        "bf16,rows<=64": _MOE_BF16_DECODE,
        "bf16,rows<=256": _moe_cfg(64, (128, 64, 4, 4), (128, 64, 4, 4)),
        "default": _MOE_BF16_PREFILL,
        "bf16,invariant-decode": _MOE_BF16_DECODE,
        "bf16,invariant-prefill": _MOE_BF16_PREFILL,
        # up to 8 rows an expert: 16-row tiles (less of each tile wasted on absent rows), weights
        # through TMA; ahead at T = 1-16 over 32 experts. At 16 rows an expert (T = 64) slower:
        # experts past 16 rows read their weights twice.
        "fp8,rows<=8": {**_moe_cfg(16, (128, 128, 4, 4), (128, 128, 4, 4)), "tma": True},
        "fp8,rows<=16": _moe_cfg(32, (128, 128, 4, 4), (128, 128, 4, 4)),
        # 17-256 rows an expert: 64-row tiles, 8 warps, ahead of 32-row tiles from T = 128 to 1024
        # over 32 experts (fewer tiles an expert, so each weight tile is read fewer times)
        "fp8,rows<=64": _moe_cfg(64, (128, 128, 8, 4), (128, 128, 8, 4)),
        "fp8,rows<=256": _moe_cfg(64, (128, 128, 8, 4), (128, 128, 8, 4)),
        "fp8,rows>256": _MOE_FP8_PREFILL,
        "fp8,invariant-decode": _MOE_FP8_DECODE,
        "fp8,invariant-prefill": _MOE_FP8_PREFILL,
    },
)


# --- prefill-side kernels (mla_prefill, sampling, moe_route) -----------------------------------
# "cpu" entries are for the Triton interpreter (tests): small tiles keep it fast.
register(
    "mla_prefill",
    "cpu",
    {"default": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
)
register(
    "mla_prefill",
    "any",
    # benchmarks/tune_prefill.py's sweep at 8 x 4096 causal, 128 heads (BM/BN/warps/stages): with K
    # and V through TMA, 128/64/8/3 led and 128/128/8/2 came close behind (with or without TMA);
    # 128/64/8/3 lost its lead without TMA, and the 64-row configs and 128/64/8/2 fell well behind
    # fp32 inputs (IEEE dots, tests only): 128/128/8/2 needs 320 KiB of shared memory on triton 3.6
    {
        "default": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "tma": True},
        "dtype=float32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    },
)
register(
    "sampling",
    "cpu",
    {"default": {"BLOCK": 256, "THRESHOLD_BLOCK": 256, "programs_per_sm": 2, "num_warps": 4}},
)
register(
    "sampling",
    "any",
    {"default": {"BLOCK": 2048, "THRESHOLD_BLOCK": 2048, "programs_per_sm": 4, "num_warps": 8}},
)
register("moe_route", "cpu", {"default": {"BLOCK_T": 8, "num_warps": 4}})
register(
    "moe_route",
    "any",
    # 256 experts (DeepSeek-V3's 8 groups): one token a one-warp program, several times faster
    # than 16 or 4 tokens on 4 warps at every T from 1 to 8192 (in a CUDA graph)
    {
        "default": {"BLOCK_T": 16, "num_warps": 4},
        "experts=64": {"BLOCK_T": 32, "num_warps": 4},
        "experts=256": {"BLOCK_T": 1, "num_warps": 1},
    },
)

# --- matmul (kernels/matmul: the batch-invariant dense GEMM), keyed "<dtype>,<phase>" ------------
# One config per (dtype, forward phase) for every M, so that a row's arithmetic never depends on the
# batch: decode splits K to fill the SMs (MIN_K_TILES_PER_SPLIT bounds the split; see
# matmul/triton.py), prefill takes large tiles and no split (MIN_K_TILES_PER_SPLIT 0: never split).
# "cpu": the interpreter.
_MATMUL_16_DECODE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
                     "num_stages": 4, "MIN_K_TILES_PER_SPLIT": 4}  # fmt: skip
_MATMUL_16_PREFILL = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                      "num_stages": 3, "MIN_K_TILES_PER_SPLIT": 0}  # fmt: skip
_MATMUL_32_DECODE = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
                     "num_stages": 2, "MIN_K_TILES_PER_SPLIT": 4}  # fmt: skip
_MATMUL_32_PREFILL = {**_MATMUL_32_DECODE, "BLOCK_M": 64, "MIN_K_TILES_PER_SPLIT": 0}
register(
    "matmul",
    "any",
    {
        "bfloat16,decode": _MATMUL_16_DECODE,
        "bfloat16,prefill": _MATMUL_16_PREFILL,
        "float16,decode": _MATMUL_16_DECODE,
        "float16,prefill": _MATMUL_16_PREFILL,
        "float32,prefill": _MATMUL_32_PREFILL,
        "default": _MATMUL_32_DECODE,
    },
)
register(
    "matmul",
    "cpu",
    {
        "default": {
            "BLOCK_M": 32,
            "BLOCK_N": 64,
            "BLOCK_K": 64,
            "GROUP_M": 4,
            "num_warps": 4,
            "num_stages": 1,
            "MIN_K_TILES_PER_SPLIT": 2,
        }
    },  # fmt: skip
)
