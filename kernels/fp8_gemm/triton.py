"""FP8 block-scaled GEMM and 1x128 activation quantization in Triton; same contract as `ref.py`.

`quantize_act` computes what the reference computes (scale = max(amax, 1e-12) / 448 per group of
128 along K, the quotient rounded to the nearest e4m3) with correctly rounded divisions, so its
scales match the reference bit for bit. `fp8_gemm` multiplies by the block-scaled weight
(W = W_fp8 * scale_inv, 128x128 quant blocks), accumulates in fp32 and returns x's dtype. For small
M it quantizes the activation inside the GEMM (one launch); for large M it quantizes once, then runs
the GEMM on fp8 operands; at M = 1 the tuned entry may name the CUDA-core kernel of `gemv.py`
instead (no tensor cores); on Hopper, M <= 64 with a long K may take the Gluon kernel of
`gluon_decode_sm90.py` (a warp-specialized TMA ring, stream-K), and large M the Gluon kernel of
`gluon_sm90.py` (wgmma overlapped with the scaling). Neither N nor K need be multiples of 128.
`scaled_gemm` is the GEMM alone on already-quantized activations.

Each 128-deep k-tile's product starts from zero and is scaled into the fp32 accumulator
(acc += dot * a_scale[m] * w_scale), which also keeps the tensor cores' reduced-precision fp8
accumulation (about 14 bits on Hopper) to 128 terms, as DeepSeek-V3 and cuBLAS do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tuning
from .._backend import interpreter_enabled, invariant_phase, tma_ok
from ..fp8_quant import (
    ACT_QUANT_GROUP,
    FP8_E4M3_MAX,
    MIN_AMAX,
    WEIGHT_QUANT_BLOCK,
    check_quantized_act,
)
from ..fp8_quant_triton import quantize_rows, quantize_tile
from ..tile_order import tile_of
from . import _splitk, gemv, gluon_decode_sm90, gluon_sm90

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, out_ptr, cnt_ptr,
    M, N, K, k_tiles_per_split, num_splits,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cs, stride_cm, stride_cn, stride_om, stride_on,
    QUANT_A: tl.constexpr, EVEN_K: tl.constexpr, UNIFORM_B: tl.constexpr, SWAP_AB: tl.constexpr,
    FOLD: tl.constexpr, A_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):  # fmt: skip
    """C[split] = sum over this split's k-tiles of (A * a_scale) @ (B * b_scale)^T.

    A: [M, K] fp8 with a_scale [M, K/128] (or a float type quantized here when QUANT_A);
    B: [N, K] fp8 with b_scale [N/128, K/128]. BLOCK_K == SCALE_BLOCK: one scale per operand row
    per k-tile. SWAP_AB computes the tile transposed, C^T = B @ A^T, so that a few rows of A are
    the MMA's narrow N side and the weight tile its M side: Hopper's wgmma needs M >= 64 but takes
    N down to 8, and keeps fp8 operands in fp8 (without the swap a 16-row tile falls back to
    mma.sync on fp8 converted to fp16). QUANT_A loads the float activation a k-tile ahead into
    registers (the quantization needs it there before the MMA; loaded in its own iteration, its
    latency stalled every k-tile), and with fewer rows
    than the tile (A_ROWS < BLOCK_M) quantizes only those and repeats them down the tile. C is
    `out` itself when K is not split; otherwise fp32 partials [splits, M, N], which FOLD adds into
    `out` in this launch (see _splitk.py).
    """
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)

    # Out-of-range rows and columns wrap (their loads stay in bounds) and are masked on store.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    kt0 = split * k_tiles_per_split
    kt1 = tl.minimum(kt0 + k_tiles_per_split, k_tiles)

    offs_k0 = kt0 * BLOCK_K + offs_k
    # QUANT_A with fewer rows than the tile (M < BLOCK_M): quantize A_ROWS rows, then repeat them
    if A_ROWS < BLOCK_M:
        offs_am = tl.arange(0, A_ROWS) % M
    else:
        offs_am = offs_m
    a_ptrs = a_ptr + offs_am.to(tl.int64)[:, None] * stride_am + offs_k0[None, :] * stride_ak
    as_row_ptrs = as_ptr + offs_m * stride_asm
    if SWAP_AB:  # B tile as [BLOCK_N, BLOCK_K]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k0[None, :] * stride_bk
    else:  # [BLOCK_K, BLOCK_N]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k0[:, None] * stride_bk
    # UNIFORM_B: the tile lies inside one 128-row quant block, so one weight scale per k-tile.
    if UNIFORM_B:
        bs_row_ptrs = bs_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
    else:
        bs_row_ptrs = bs_ptr + (offs_n // SCALE_BLOCK) * stride_bsn

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The scales are loaded a k-tile ahead too: Triton's pipeliner leaves them as plain loads in
    # the iteration that uses them, whose latency then stalled every k-tile.
    if QUANT_A:  # the float activation is loaded a k-tile ahead, into registers
        a_next = tl.load(a_ptrs, mask=(offs_k0 < K)[None, :], other=0.0)
    else:
        a_s_next = tl.load(as_row_ptrs + kt0 * stride_ask)
    b_s_next = tl.load(bs_row_ptrs + kt0 * stride_bsk)
    for kt in range(kt0, kt1):
        kt_next = tl.minimum(kt + 1, kt1 - 1)  # the last k-tile reloads its own scales
        b_s = b_s_next
        b_s_next = tl.load(bs_row_ptrs + kt_next * stride_bsk)
        k_mask = kt * BLOCK_K + offs_k < K  # used when not EVEN_K
        if QUANT_A:
            a = a_next
            k_next = (kt + 1) * BLOCK_K + offs_k
            k_ok = (k_next < K) & (k_next < kt1 * BLOCK_K)  # nothing past the split
            a_next = tl.load(a_ptrs + BLOCK_K * stride_ak, mask=k_ok[None, :], other=0.0)
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        if EVEN_K:
            b = tl.load(b_ptrs)
        elif SWAP_AB:
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if QUANT_A:
            a, a_s = quantize_tile(a.to(tl.float32), FP8_MAX, MIN_AMAX, EXACT_CAST)
            if A_ROWS < BLOCK_M:  # tile row r holds row r % A_ROWS (rows past M are not stored)
                a = tl.reshape(
                    tl.broadcast_to(a[None, :, :], (BLOCK_M // A_ROWS, A_ROWS, BLOCK_K)),
                    (BLOCK_M, BLOCK_K),
                )
                a_s = tl.reshape(
                    tl.broadcast_to(a_s[None, :], (BLOCK_M // A_ROWS, A_ROWS)), (BLOCK_M,)
                )
        else:
            a_s = a_s_next
            a_s_next = tl.load(as_row_ptrs + kt_next * stride_ask)
        if SWAP_AB:
            if UNIFORM_B:
                acc += tl.dot(b, tl.trans(a)) * (a_s * b_s)[None, :]
            else:
                acc += tl.dot(b, tl.trans(a)) * (b_s[:, None] * a_s[None, :])
        elif UNIFORM_B:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP_AB:
        rows, cols = out_m.to(tl.int64)[None, :], out_n[:, None]
        mask = (out_m < M)[None, :] & (out_n < N)[:, None]
    else:
        rows, cols = out_m.to(tl.int64)[:, None], out_n[None, :]
        mask = (out_m < M)[:, None] & (out_n < N)[None, :]
    _splitk.finish_tile(
        acc, c_ptr + rows * stride_cm + cols * stride_cn,
        out_ptr + rows * stride_om + cols * stride_on, mask,
        cnt_ptr + tl.program_id(0), split, num_splits, stride_cs, FOLD,
    )  # fmt: skip


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, as_ptr, b_desc, bs_ptr, c_ptr,
    M, N, K,
    stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
    UNIFORM_B: tl.constexpr, LAG: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    """The GEMM on pre-quantized A, both operands through TMA descriptors (zero fill past the
    edges). LAG (needs UNIFORM_B) scales the previous k-tile's product into the accumulator
    while the current one's MMA runs, so the FMAs can overlap the tensor cores."""
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1)
    as_ptrs = as_ptr + offs_m * stride_asm
    if UNIFORM_B:
        bs_ptrs = bs_ptr + (off_n // SCALE_BLOCK) * stride_bsn
    else:
        offs_n = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1)
        bs_ptrs = bs_ptr + (offs_n // SCALE_BLOCK) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LAG:
        prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        prev_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for kt in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([off_m, kt * BLOCK_K])
        b = b_desc.load([off_n, kt * BLOCK_K])
        a_s = tl.load(as_ptrs + kt * stride_ask)
        b_s = tl.load(bs_ptrs + kt * stride_bsk)
        if LAG:
            product = tl.dot(a, b.T)
            acc += prev * prev_scale[:, None]
            prev = product
            prev_scale = a_s * b_s
        elif UNIFORM_B:
            acc += tl.dot(a, b.T) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b.T) * (a_s[:, None] * b_s[None, :])
    if LAG:
        acc += prev * prev_scale[:, None]

    out_m = off_m + tl.arange(0, BLOCK_M)
    out_n = off_n + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + out_m.to(tl.int64)[:, None] * stride_cm + out_n[None, :] * stride_cn
    mask = (out_m < M)[:, None] & (out_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _check_float_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected 2-D bf16/fp16/fp32, got {t.dtype} {tuple(t.shape)}")


def quantize_act(
    x: torch.Tensor, group_size: int = ACT_QUANT_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K]. Returns x_fp8 [M, K] float8_e4m3fn and scales [M, ceil(K/group_size)] fp32."""
    _check_float_2d("x", x)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size}: expected a power of two >= 16")
    return quantize_rows(x, group_size, scale_column_major=False)


def _gemm_key(m: int) -> str:
    """The shape class of M; in batch-invariant mode one class per phase for every M."""
    phase = invariant_phase()
    if phase is not None:
        return f"invariant-{phase}"
    for bound in (1, 16, 32, 64, 128):
        if m <= bound:
            return f"m<={bound}"
    return "m>128"


def _gemm_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The tuned config for an [M, K] activation times an [N, K] weight: the shape's own entry
    ("<class>,n=N,k=K", for projections whose best config differs from their class's) where the
    table has one, else the class's. A CUDA-core (gemv) entry names the shape class to use instead
    past its max_m / max_k. Batch-invariant mode keeps one entry a phase for every shape."""
    key = _gemm_key(m)
    cfg = None
    if not key.startswith("invariant"):
        cfg = tuning.find("fp8_gemm", f"{key},n={n},k={k}", device)
    if cfg is None:
        cfg = tuning.lookup("fp8_gemm", key, device)
    if cfg.get("gemv") and (m > cfg["max_m"] or k > cfg.get("max_k", k)):
        cfg = tuning.lookup("fp8_gemm", cfg["otherwise"], device)
    return cfg


def _gluon_decode(cfg: dict, m: int, k: int, device: torch.device) -> dict | None:
    """The config of the Gluon decode kernel (gluon_decode_sm90.py) where it serves this call: the
    entry names one, the GPU is a Hopper, M is within min_m .. 64 and K reaches min_k. Else None."""
    gd = cfg.get("gluon_decode")
    if gd is None or not gd["min_m"] <= m <= gluon_decode_sm90.MAX_M or k < gd["min_k"]:
        return None
    return gd if gluon_decode_sm90.available(device) else None


def _quantize_inside(cfg: dict, n: int, k: int) -> bool:
    """Whether the GEMM quantizes the activation itself (fuse_quant). Each block of BLOCK_N weight
    rows then quantizes the rows' K again; past the config's fuse_max_work elements over all
    blocks, one quantization beforehand (the fixed cost of one more small launch) costs less."""
    work = triton.cdiv(n, cfg["BLOCK_N"]) * k
    return cfg["fuse_quant"] and work <= cfg.get("fuse_max_work", float("inf"))


def _check_weight(
    w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, k: int, device: torch.device
) -> None:
    if w_fp8.dim() != 2 or w_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w_fp8: expected 2-D e4m3 [N, K], got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    n = w_fp8.shape[0]
    if w_fp8.shape[1] != k:
        raise ValueError(f"w_fp8 is [N, K]={tuple(w_fp8.shape)} but x has K={k}")
    b = WEIGHT_QUANT_BLOCK
    want = (triton.cdiv(n, b), triton.cdiv(k, b))
    if w_scale_inv.dtype != torch.float32 or tuple(w_scale_inv.shape) != want:
        raise ValueError(
            f"w_scale_inv: expected fp32 {want} (one per {b}x{b} quant block), "
            f"got {w_scale_inv.dtype} {tuple(w_scale_inv.shape)}"
        )
    if w_fp8.device != device or w_scale_inv.device != device:
        raise ValueError(f"w_fp8 and w_scale_inv must be on {device}")


def _launch_tma(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
) -> None:
    m, k = a.shape
    n = w_fp8.shape[0]
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], WEIGHT_QUANT_BLOCK
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(w_fp8, [block_n, block_k])
    uniform_b = WEIGHT_QUANT_BLOCK % block_n == 0
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_tma_kernel[grid](
        a_desc, a_scales, b_desc, w_scale_inv, out, m, n, k,
        a_scales.stride(0), a_scales.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        out.stride(0), out.stride(1),
        UNIFORM_B=uniform_b, LAG=cfg.get("lag", False) and uniform_b,
        WARP_SPECIALIZE=cfg.get("warp_specialize", False),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        SCALE_BLOCK=WEIGHT_QUANT_BLOCK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def _launch_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor | None,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
) -> None:
    m, k = a.shape
    n = w_fp8.shape[0]
    if cfg.get("gemv"):
        splits, per_split = gemv.gemv_splits(n, k, cfg)
        target, cnt, fold = _splitk.prepare(out, splits, triton.cdiv(n, cfg["BLOCK_N"]))
        gemv.launch_gemv(
            a, a_scales, w_fp8, w_scale_inv, target, out, cnt, fold, per_split, cfg,
            FP8_E4M3_MAX, MIN_AMAX,
        )  # fmt: skip
        _splitk.finish(target, out, fold)
        return
    gd = _gluon_decode(cfg, m, k, a.device)
    # launch returns False where it cannot run (no tile counters inside a graph capture): tl.dot below
    if (
        gd
        and a_scales is not None
        and tma_ok(a)
        and tma_ok(w_fp8)
        and gluon_decode_sm90.launch(a, a_scales, w_fp8, w_scale_inv, out, gd, WEIGHT_QUANT_BLOCK)
    ):
        return
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], WEIGHT_QUANT_BLOCK
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    # Split K when the output tiles alone cannot fill the machine (decode shapes with small N).
    splits = 1
    if cfg.get("split_k_target_ctas"):
        # "one_wave": at most the target (the CTAs the GPU holds at once), so that no CTA waits for a slot
        if cfg.get("one_wave"):
            wanted = cfg["split_k_target_ctas"] // tiles
        else:
            wanted = triton.cdiv(cfg["split_k_target_ctas"], tiles)
        splits = max(1, min(wanted, k_tiles // cfg["min_k_tiles"]))
    per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, per_split)
    quant_a = a_scales is None
    if not quant_a and splits == 1 and tma_ok(a) and tma_ok(w_fp8):
        if cfg.get("gluon") and gluon_sm90.available(a.device) and tma_ok(out):
            gluon_sm90.launch(a, a_scales, w_fp8, w_scale_inv, out, cfg, WEIGHT_QUANT_BLOCK)
            return
        if cfg.get("tma"):
            _launch_tma(a, a_scales, w_fp8, w_scale_inv, out, cfg)
            return
    if quant_a:
        a_scales = torch.empty((1, 1), dtype=torch.float32, device=a.device)  # unread
    target, cnt, fold = _splitk.prepare(out, splits, tiles)
    stride_cs = target.stride(0) if splits > 1 else 0
    _fp8_gemm_kernel[(tiles, splits)](
        a, a_scales, w_fp8, w_scale_inv, target, out, cnt,
        m, n, k, per_split, splits,
        a.stride(0), a.stride(1), a_scales.stride(0), a_scales.stride(1),
        w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        stride_cs, target.stride(-2), target.stride(-1), out.stride(0), out.stride(1),
        QUANT_A=quant_a, EVEN_K=k % block_k == 0, UNIFORM_B=WEIGHT_QUANT_BLOCK % block_n == 0,
        SWAP_AB=cfg.get("swap_ab", False), FOLD=fold,
        A_ROWS=min(block_m, triton.next_power_of_2(m)) if quant_a else block_m,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        SCALE_BLOCK=WEIGHT_QUANT_BLOCK, FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX,
        EXACT_CAST=interpreter_enabled(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    _splitk.finish(target, out, fold)


def scaled_gemm(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The GEMM alone: x_fp8 [M, K] e4m3 with x_scales [M, ceil(K/128)] fp32 (any strides;
    column-major loads fastest), w_fp8 [N, K] with w_scale_inv [ceil(N/128), ceil(K/128)].
    Returns [M, N] in out_dtype."""
    check_quantized_act(x_fp8, x_scales)
    m, k = x_fp8.shape
    _check_weight(w_fp8, w_scale_inv, k, x_fp8.device)
    out = torch.empty((m, w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    cfg = _gemm_config(m, w_fp8.shape[0], k, x_fp8.device)
    _launch_gemm(x_fp8, x_scales, w_fp8, w_scale_inv, out, cfg)
    return out


def fp8_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float; w_fp8: [N, K] e4m3; w_scale_inv: [ceil(N/128), ceil(K/128)].
    Returns [M, N] in x's dtype."""
    _check_float_2d("x", x)
    m, k = x.shape
    _check_weight(w_fp8, w_scale_inv, k, x.device)
    out = torch.empty((m, w_fp8.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = _gemm_config(m, w_fp8.shape[0], k, x.device)
    if _gluon_decode(cfg, m, k, x.device) is None and _quantize_inside(cfg, w_fp8.shape[0], k):
        _launch_gemm(x, None, w_fp8, w_scale_inv, out, cfg)
    else:
        x_fp8, x_scales = quantize_rows(x, ACT_QUANT_GROUP, scale_column_major=True)
        _launch_gemm(x_fp8, x_scales, w_fp8, w_scale_inv, out, cfg)
    return out
