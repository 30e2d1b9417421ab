"""Fused MoE in Triton; same contract as `ref.py` (bf16/fp16/fp32 weights, or fp8 w8a8 with 128x128
weight blocks and 1x128 activation groups).

Five steps on the device, with no host sync (a CUDA graph can capture them):
1. align (`_triton_layout.align_rows`): each expert's assignments get a run of rows padded to
   BLOCK_M; an id outside [0, E) gets no row and contributes nothing.
2. fp8: quantize x in 1x128 groups, once per token; or, with `permute_a`, copy x into the row
   layout (`_triton_layout.permute_rows`, quantizing on the way for fp8).
3. gate/up grouped GEMM over the rows (x gathered by token), SiLU(gate) * up in the epilogue:
   act [rows, I] (fp8: quantized in the same epilogue; a 128-column tile is one quant group).
4. down grouped GEMM: y [rows, D] in x's dtype.
   (fp8 on Hopper with `gluon` in the config: steps 3 and 4 are the Gluon kernels of
   `gluon_sm90.py`, which overlap each k-tile's block scaling with the next k-tile's wgmma.)
5. combine: out[t] = sum_j topk_weights[t, j] * y[row_of[t, j]] in fp32, then x's dtype.
M-tiles past the padded total find no expert and exit, so grids are sized from T*k alone.

One file past 500 lines on purpose: the op's kernels and the launcher that chains them share the row layout,
the tile sizes and the config keys, and are read as one pipeline (the layout steps and the Hopper Gluon GEMMs
are apart already).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tuning
from .._backend import interpreter_enabled, invariant_phase, tma_ok
from ..fp8_quant import ACT_QUANT_GROUP, FP8_E4M3_MAX, MIN_AMAX, WEIGHT_QUANT_BLOCK
from ..fp8_quant_triton import empty_quantized, quantize_rows, quantize_tile
from ..tile_order import tile_of
from . import gluon_sm90
from ._triton_layout import align_rows, permute_rows
from .ref import check_tree, check_x_q

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


# ---- 3, 4. grouped GEMMs -------------------------------------------------------------------------
@triton.jit
def _expert_of(ends_ptr, row0, num_experts, E_POW2: tl.constexpr):
    """The expert whose padded run holds row `row0`; num_experts when row0 is past the last run."""
    e = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + e, mask=e < num_experts, other=2**30)
    return tl.sum((ends <= row0).to(tl.int32), axis=0)


@triton.jit
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, acts_ptr, sorted_ids_ptr, ends_ptr,
    num_experts, num_assignments, top_k, inter, hidden, num_pid_m,
    stride_xm, stride_xk, stride_xsm, stride_xsk,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_am, stride_ak, stride_asm, stride_ask,
    FP8: tl.constexpr, EVEN_K: tl.constexpr, UNIFORM_B: tl.constexpr, TMA_B: tl.constexpr,
    PERMUTED_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):  # fmt: skip
    """act[rows, n] = silu(x[tok] @ gate[e, n]) * (x[tok] @ up[e, n]) on one expert's M-tile.

    TMA_B: w_ptr is a TMA descriptor over w13 viewed as [E * 2I, D] (block [BLOCK_N, BLOCK_K]);
    columns past I read the next rows, whose results are never stored. PERMUTED_A: x_ptr is a
    TMA descriptor over x already laid out by row (`_permute_rows_kernel`), xs_ptr its scales."""
    pid_m, pid_n = tile_of(tl.program_id(0), num_pid_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    row0 = pid_m * BLOCK_M
    e = _expert_of(ends_ptr, row0, num_experts, E_POW2)
    if e >= num_experts:
        return
    e64 = e.to(tl.int64)
    if PERMUTED_A:
        tok = row0 + tl.arange(0, BLOCK_M)  # the scales' row is the row itself
    else:
        ids = tl.load(sorted_ids_ptr + row0 + tl.arange(0, BLOCK_M))
        valid = ids < num_assignments
        tok = tl.where(valid, ids // top_k, 0)
        a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xm
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter
    offs_k = tl.arange(0, BLOCK_K)
    if not PERMUTED_A:
        a_ptrs += offs_k[None, :] * stride_xk
    if not TMA_B:
        g_ptrs = w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn
        g_ptrs += offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        as_ptrs = xs_ptr + tok * stride_xsm
        if UNIFORM_B:
            ws_ptr += e64 * stride_wse
            gs_ptrs = ws_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
            us_ptrs = ws_ptr + ((inter + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
        else:
            ws_ptr += e64 * stride_wse
            gs_ptrs = ws_ptr + (offs_n // SCALE_BLOCK) * stride_wsn
            us_ptrs = ws_ptr + ((inter + offs_n) // SCALE_BLOCK) * stride_wsn

        # scales a k-tile ahead, as in fp8_gemm/triton.py (plain loads stall the k-tile using them)
        a_s_next = tl.load(as_ptrs)
        g_s_next = tl.load(gs_ptrs)
        u_s_next = tl.load(us_ptrs)

    gate_row = e * 2 * inter + pid_n * BLOCK_N  # TMA_B: first w13 row of this tile
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    for kt in range(k_tiles):
        if not EVEN_K:
            k_mask = kt * BLOCK_K + offs_k < hidden
        if PERMUTED_A:
            a = x_ptr.load([row0, kt * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if TMA_B:
            g = w_ptr.load([gate_row, kt * BLOCK_K]).T
            u = w_ptr.load([gate_row + inter, kt * BLOCK_K]).T
        elif EVEN_K:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            g = tl.load(g_ptrs, mask=k_mask[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_mask[:, None], other=0.0)
        if FP8:  # each 128-deep product scaled into fp32 (see fp8_gemm/triton.py)
            kt_next = tl.minimum(kt + 1, k_tiles - 1)
            a_s, g_s, u_s = a_s_next, g_s_next, u_s_next
            a_s_next = tl.load(as_ptrs + kt_next * stride_xsk)
            g_s_next = tl.load(gs_ptrs + kt_next * stride_wsk)
            u_s_next = tl.load(us_ptrs + kt_next * stride_wsk)
            if UNIFORM_B:
                acc_g += tl.dot(a, g) * (a_s * g_s)[:, None]
                acc_u += tl.dot(a, u) * (a_s * u_s)[:, None]
            else:
                acc_g += tl.dot(a, g) * (a_s[:, None] * g_s[None, :])
                acc_u += tl.dot(a, u) * (a_s[:, None] * u_s[None, :])
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        if not PERMUTED_A:
            a_ptrs += BLOCK_K * stride_xk
        if not TMA_B:
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    out_ptrs = act_ptr + rows[:, None] * stride_am + cols[None, :] * stride_ak
    if FP8:
        # One tile of BLOCK_N == 128 columns is one activation quant group of the down GEMM.
        act = tl.where(col_mask[None, :], act, 0.0)
        q, scale = quantize_tile(act, FP8_MAX, MIN_AMAX, EXACT_CAST)
        tl.store(out_ptrs, q, mask=col_mask[None, :])
        tl.store(acts_ptr + rows * stride_asm + pid_n * stride_ask, scale)
    else:
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, acts_ptr, w_ptr, ws_ptr, y_ptr, ends_ptr,
    num_experts, hidden, inter, num_pid_m,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_ym, stride_yn,
    FP8: tl.constexpr, EVEN_K: tl.constexpr, UNIFORM_B: tl.constexpr, TMA_B: tl.constexpr,
    TMA_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    """y[rows, n] = act[rows] @ w2[e, n] for one M-tile of one expert's rows.

    TMA_B: w_ptr is a TMA descriptor over w2 viewed as [E * D, I] (block [BLOCK_N, BLOCK_K]).
    TMA_A: act_ptr is a TMA descriptor over act (block [BLOCK_M, BLOCK_K])."""
    pid_m, pid_n = tile_of(tl.program_id(0), num_pid_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    row0 = pid_m * BLOCK_M
    e = _expert_of(ends_ptr, row0, num_experts, E_POW2)
    if e >= num_experts:
        return
    e64 = e.to(tl.int64)
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    if not TMA_A:
        a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not TMA_B:
        b_ptrs = w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn
        b_ptrs += offs_k[:, None] * stride_wk
    b_row = e * hidden + pid_n * BLOCK_N  # TMA_B: first w2 row of this tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        as_ptrs = acts_ptr + rows * stride_asm
        if UNIFORM_B:
            bs_ptrs = ws_ptr + e64 * stride_wse + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
        else:
            bs_ptrs = ws_ptr + e64 * stride_wse + (offs_n // SCALE_BLOCK) * stride_wsn
        a_s_next = tl.load(as_ptrs)  # a k-tile ahead, as in the gate/up kernel
        b_s_next = tl.load(bs_ptrs)

    k_tiles = tl.cdiv(inter, BLOCK_K)
    for kt in range(k_tiles):
        if not EVEN_K:
            k_mask = kt * BLOCK_K + offs_k < inter
        if TMA_A:
            a = act_ptr.load([row0, kt * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        if TMA_B:
            b = w_ptr.load([b_row, kt * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if FP8:
            kt_next = tl.minimum(kt + 1, k_tiles - 1)
            a_s, b_s = a_s_next, b_s_next
            a_s_next = tl.load(as_ptrs + kt_next * stride_ask)
            b_s_next = tl.load(bs_ptrs + kt_next * stride_wsk)
            if UNIFORM_B:
                acc += tl.dot(a, b) * (a_s * b_s)[:, None]
            else:
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, b, acc)
        if not TMA_A:
            a_ptrs += BLOCK_K * stride_ak
        if not TMA_B:
            b_ptrs += BLOCK_K * stride_wk
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(cols < hidden)[None, :])


# ---- 5. combine ----------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(
    y_ptr, row_of_ptr, w_ptr, out_ptr, hidden, top_k,
    stride_ym, stride_wt, stride_wk, stride_ot,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < hidden
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(top_k):
        row = tl.load(row_of_ptr + t * top_k + j)
        weight = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        y = tl.load(
            y_ptr + tl.maximum(row, 0).to(tl.int64) * stride_ym + offs,
            mask=d_mask & (tl.zeros_like(offs) + row >= 0),
            other=0.0,
        )
        acc += weight * y.to(tl.float32)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _combine_tree_kernel(
    y_ptr, row_of_ptr, w_ptr, ids_ptr, out_ptr, hidden, top_k, group_size,
    stride_ym, stride_wt, stride_wk, stride_it, stride_ik, stride_ot,
    GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`_combine_kernel` summed as `ref.tree_combine` says: per group of experts in slot order, then the
    groups as a balanced binary tree; stores fp32."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < hidden
    groups = tl.arange(0, GROUPS)
    acc = tl.zeros((GROUPS, BLOCK_D), dtype=tl.float32)
    for j in range(top_k):
        row = tl.load(row_of_ptr + t * top_k + j)
        weight = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        expert = tl.load(ids_ptr + t * stride_it + j * stride_ik).to(tl.int64)
        group = tl.where(row >= 0, expert // group_size, -1)  # another rank's expert: no group here
        y = tl.load(
            y_ptr + tl.maximum(row, 0).to(tl.int64) * stride_ym + offs,
            mask=d_mask & (tl.zeros_like(offs) + row >= 0),
            other=0.0,
        )
        contribution = weight * y.to(tl.float32)
        acc += tl.where((groups == group)[:, None], contribution[None, :], 0.0)
    # the balanced tree: neighbours first, each level one exact-order add per pair
    if GROUPS >= 16:
        acc = tl.sum(tl.reshape(acc, (8, 2, BLOCK_D)), axis=1)
    if GROUPS >= 8:
        acc = tl.sum(tl.reshape(acc, (4, 2, BLOCK_D)), axis=1)
    if GROUPS >= 4:
        acc = tl.sum(tl.reshape(acc, (2, 2, BLOCK_D)), axis=1)
    if GROUPS >= 2:
        acc = tl.sum(tl.reshape(acc, (1, 2, BLOCK_D)), axis=1)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs
    tl.store(out_ptrs, tl.reshape(acc, (BLOCK_D,)), mask=d_mask)


# ---- launcher ------------------------------------------------------------------------------------
def _check_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
) -> bool:
    """Raises ValueError on a bad input; returns whether the weights are fp8."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected [T, D] bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
    t, d = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    e, inter2 = w13.shape[:2]
    if inter2 % 2 or w13.shape[2] != d:
        raise ValueError(f"w13: expected [E, 2I, D={d}], got {tuple(w13.shape)}")
    inter = inter2 // 2
    if tuple(w2.shape) != (e, d, inter):
        raise ValueError(f"w2: expected [E, D, I]={(e, d, inter)}, got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in _INT_DTYPES:
        got = f"{topk_ids.dtype} {tuple(topk_ids.shape)}"
        raise ValueError(f"topk_ids: expected int32/int64 [T={t}, k], got {got}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights: expected float {tuple(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    named = {"w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    for name, tensor in named.items():
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    if (w13_scale_inv is None) != (w2_scale_inv is None):
        raise ValueError("give both w13_scale_inv and w2_scale_inv (fp8) or neither")
    fp8 = w13_scale_inv is not None
    if not fp8:
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have x's dtype {x.dtype}")
        return False
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 MoE needs float8_e4m3fn weights, got {w13.dtype} and {w2.dtype}")
    b = WEIGHT_QUANT_BLOCK
    for name, scale, want in (
        ("w13_scale_inv", w13_scale_inv, (e, triton.cdiv(inter2, b), triton.cdiv(d, b))),
        ("w2_scale_inv", w2_scale_inv, (e, triton.cdiv(d, b), triton.cdiv(inter, b))),
    ):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.device != x.device:
            raise ValueError(
                f"{name}: expected fp32 {want} on {x.device}, "
                f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
            )
    return True


def _config_key(fp8: bool, num_assignments: int, num_experts: int) -> str:
    """Shape class: weight format and mean rows per expert (decode: a few; prefill: hundreds); in
    batch-invariant mode one class per phase for every batch."""
    phase = invariant_phase()
    if phase is not None:
        return f"{'fp8' if fp8 else 'bf16'},invariant-{phase}"
    rows_per_expert = num_assignments / num_experts
    bound = next((f"rows<={b}" for b in (8, 16, 64, 256) if rows_per_expert <= b), "rows>256")
    return f"{'fp8' if fp8 else 'bf16'},{bound}"


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I]; topk_weights: [T, k] fp32; topk_ids: [T, k] int.

    Scales (fp8 only): w13_scale_inv [E, ceil(2I/128), ceil(D/128)],
    w2_scale_inv [E, ceil(D/128), ceil(I/128)]. x_q (fp8 only): x already quantized, as
    `ref.fused_moe` says; no quantization launch of its own then. An id outside [0, E) contributes
    nothing (used for experts owned by another rank). tree: `ref.fused_moe`'s. Returns [T, D].
    """
    fp8 = _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv)
    check_x_q(x, x_q, fp8)
    check_tree(tree)
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out_dtype = x.dtype if tree is None else torch.float32
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    cfg = tuning.lookup("fused_moe", _config_key(fp8, num_tokens * top_k, num_experts), x.device)
    cfg = _fit_operand_width(cfg, x.element_size())
    return _fused_moe(
        x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, cfg, out, x_q, tree
    )


def _fit_operand_width(cfg: dict, element_size: int) -> dict:
    """The tuned configs size their pipelines' shared memory for 2-byte operands; 4-byte (fp32)
    operands keep the same bytes per stage set by running half as many stages (at least one)."""
    if element_size <= 2:
        return cfg
    shrink = element_size // 2
    return {
        **cfg,
        "stages1": max(1, cfg["stages1"] // shrink),
        "stages2": max(1, cfg["stages2"] // shrink),
    }


def _weight_operand(
    w: torch.Tensor, block_n: int, block_k: int, use_tma: bool
) -> tuple[torch.Tensor | TensorDescriptor, bool]:
    """The weight as the GEMM kernels take it: a TMA descriptor over its [E * rows, K] view when
    asked for and possible, else the tensor itself. Returns (operand, is_descriptor)."""
    if use_tma and w.is_contiguous() and tma_ok(w.view(-1, w.shape[-1])):
        return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k]), True
    return w, False


def _grouped_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w: torch.Tensor,
    w_s: torch.Tensor,
    y: torch.Tensor,
    *,
    ends: torch.Tensor,
    num_pid_m: int,
    fp8: bool,
    cfg: dict,
    tiles: tuple[int, int, int, int],
    tma_a: bool,
) -> None:
    """Step 4: y[rows] = a[rows] @ w[expert of the row]^T over the row layout; tiles:
    (BLOCK_N, BLOCK_K, num_warps, num_stages); tma_a reads a through a TMA descriptor."""
    num_experts, n, k = w.shape
    bn, bk, warps, stages = tiles
    block_m = cfg["BLOCK_M"]
    w_arg, tma_b = _weight_operand(w, bn, bk, cfg.get("tma", False))
    tma_a = tma_a and tma_ok(a)
    a_arg = TensorDescriptor.from_tensor(a, [block_m, bk]) if tma_a else a
    sb = WEIGHT_QUANT_BLOCK
    _down_kernel[(num_pid_m * triton.cdiv(n, bn),)](
        a_arg, a_scales, w_arg, w_s, y, ends,
        num_experts, n, k, num_pid_m,
        a.stride(0), a.stride(1), a_scales.stride(0), a_scales.stride(1),
        *w.stride(), *w_s.stride(),
        y.stride(0), y.stride(1),
        FP8=fp8, EVEN_K=k % bk == 0, UNIFORM_B=sb % bn == 0, TMA_B=tma_b, TMA_A=tma_a,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        E_POW2=triton.next_power_of_2(num_experts), SCALE_BLOCK=sb,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
    cfg: dict,
    out: torch.Tensor,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: tuple[int, int] | None = None,
) -> torch.Tensor:
    """fused_moe with an explicit launch config (tests and the sweep pass their own)."""
    fp8 = w13_scale_inv is not None
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    block_m = cfg["BLOCK_M"]
    sorted_ids, ends, row_of, max_rows = align_rows(topk_ids, num_experts, block_m)
    num_pid_m = max_rows // block_m
    e_pow2 = triton.next_power_of_2(num_experts)
    sb = WEIGHT_QUANT_BLOCK
    num_a = num_tokens * top_k
    permuted = cfg.get("permute_a", False) and hidden * (1 if fp8 else x.element_size()) % 16 == 0
    if fp8:
        for name in ("BLOCK_K1", "BLOCK_K2", "BLOCK_N1"):
            assert cfg[name] == sb, f"fused_moe fp8 config needs {name} == {sb}"
        if x_q is not None and not permuted:
            x_in, x_scales = x_q  # the kernels take the scales' strides as they come
        elif permuted and (x_q is not None or cfg.get("prequant")):
            xq, xs = x_q or quantize_rows(x, ACT_QUANT_GROUP, scale_column_major=False)
            x_in, _ = permute_rows(xq, sorted_ids, ends, num_a, top_k, max_rows, False)
            x_scales, _ = permute_rows(xs, sorted_ids, ends, num_a, top_k, max_rows, False)
        elif permuted:
            x_in, x_scales = permute_rows(x, sorted_ids, ends, num_a, top_k, max_rows, True)
        else:
            x_in, x_scales = quantize_rows(x, ACT_QUANT_GROUP, scale_column_major=False)
        # column-major scales: a tile's 128 rows read (and write) their scale of a k-tile contiguously
        act, act_scales = empty_quantized(max_rows, inter, x.device, sb)
        w13_s, w2_s = w13_scale_inv, w2_scale_inv
    else:
        if permuted:
            x_in, x_scales = permute_rows(x, sorted_ids, ends, num_a, top_k, max_rows, False)
        else:
            x_in, x_scales = x, torch.empty((1, 1), dtype=torch.float32, device=x.device)  # unread
        act = torch.empty((max_rows, inter), dtype=x.dtype, device=x.device)
        act_scales = x_scales
        w13_s = w2_s = torch.empty((1, 1, 1), dtype=torch.float32, device=x.device)

    if fp8 and permuted and gluon_sm90.usable(x_in, w13, w2, cfg):
        y = torch.empty((max_rows, hidden), dtype=x.dtype, device=x.device)
        tile_expert = gluon_sm90.tile_experts(ends, max_rows)
        gluon_sm90.gate_up(x_in, x_scales, w13, w13_s, act, act_scales, tile_expert, cfg)
        if cfg.get("gluon_down", True):
            gluon_sm90.down(act, act_scales, w2, w2_s, y, tile_expert, cfg)
            return _combine(y, row_of, topk_weights, out, topk_ids, tree)
    else:
        bn1, bk1 = cfg["BLOCK_N1"], cfg["BLOCK_K1"]
        w13_arg, tma1 = _weight_operand(w13, bn1, bk1, cfg.get("tma", False))
        x_arg = TensorDescriptor.from_tensor(x_in, [block_m, bk1]) if permuted else x_in
        _gate_up_kernel[(num_pid_m * triton.cdiv(inter, bn1),)](
            x_arg, x_scales, w13_arg, w13_s, act, act_scales, sorted_ids, ends,
            num_experts, num_tokens * top_k, top_k, inter, hidden, num_pid_m,
            x_in.stride(0), x_in.stride(1), x_scales.stride(0), x_scales.stride(1),
            *w13.stride(), *w13_s.stride(),
            act.stride(0), act.stride(1), act_scales.stride(0), act_scales.stride(1),
            FP8=fp8, EVEN_K=hidden % bk1 == 0, UNIFORM_B=sb % bn1 == 0 and inter % sb == 0,
            TMA_B=tma1, PERMUTED_A=permuted,
            BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=cfg["GROUP_M"],
            E_POW2=e_pow2, SCALE_BLOCK=sb, FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=MIN_AMAX,
            EXACT_CAST=interpreter_enabled(),
            num_warps=cfg["warps1"], num_stages=cfg["stages1"],
        )  # fmt: skip
        y = torch.empty((max_rows, hidden), dtype=x.dtype, device=x.device)

    tiles2 = (cfg["BLOCK_N2"], cfg["BLOCK_K2"], cfg["warps2"], cfg["stages2"])
    _grouped_gemm(act, act_scales, w2, w2_s, y, ends=ends, num_pid_m=num_pid_m, fp8=fp8, cfg=cfg,
                  tiles=tiles2, tma_a=cfg.get("tma_act", False))  # fmt: skip
    return _combine(y, row_of, topk_weights, out, topk_ids, tree)


def _combine(
    y: torch.Tensor,
    row_of: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    tree: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Step 5: out[t] = sum_j topk_weights[t, j] * y[row_of[t, j]] (in slot order, or by `tree`)."""
    num_tokens, hidden = out.shape
    top_k = topk_weights.shape[1]
    if tree is not None:
        groups, group_size = tree
        block_d = max(16, min(1024, triton.next_power_of_2(hidden), 8192 // groups))
        _combine_tree_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
            y, row_of, topk_weights, topk_ids, out, hidden, top_k, group_size,
            y.stride(0), topk_weights.stride(0), topk_weights.stride(1), topk_ids.stride(0),
            topk_ids.stride(1), out.stride(0), GROUPS=groups, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
        return out
    block_d = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        y, row_of, topk_weights, out, hidden, top_k,
        y.stride(0), topk_weights.stride(0), topk_weights.stride(1), out.stride(0),
        BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out
