"""Interleaved RoPE in place on q_pe and k_pe in Triton: same contract as `ref.rope`.

One program rotates BLOCK_H heads of one token's q_pe; the programs of head-block 0 also rotate that
token's k_pe. Pairs (x[2i], x[2i+1]) are read and written through strides, so q_pe may be the
non-contiguous rope slice of q (`q.view(T, H, 192).split([128, 64], -1)[1]`); only the pair elements
are touched. Math is fp32, rounded once to the tensor's dtype, as in the reference. Positions must
lie in [0, cos_sin.shape[0]); they are not checked on the device (that would need a sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from ..kv_cache_checks import float_cache_inputs, fp8_cache_inputs
from ..kv_row_fp8 import FP8_E4M3_MAX
from ..kv_row_triton import quantize_row_fp8, slot_row

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

tuning.register(
    "rope",
    "any",
    {
        # key: "h=<heads>"; BLOCK_H heads per program.
        "default": {"BLOCK_H": 16, "num_warps": 4},
        "h=1": {"BLOCK_H": 1, "num_warps": 1},
        "h=16": {"BLOCK_H": 16, "num_warps": 2},
        "h=128": {"BLOCK_H": 32, "num_warps": 4},
    },
)


@triton.jit
def _rotate(
    ptr, out_ptr, offs_h, mask_h, stride_h, stride_r, stride_oh, stride_or, cos, sin,
    ROPE: tl.constexpr,
):  # fmt: skip
    """Rotates pairs (2i, 2i+1) of rows ptr + h * stride_h into rows out_ptr + h * stride_oh (the same
    rows for in place); cos, sin: [ROPE / 2] fp32. Each row is read whole (contiguous along R) and
    split into its pairs in registers."""
    offs_r = tl.arange(0, ROPE)
    ptrs = ptr + offs_h[:, None] * stride_h + offs_r[None, :] * stride_r  # [BLOCK_H, R]
    mask = mask_h[:, None]
    x = tl.load(ptrs, mask=mask, other=0.0)
    pairs = tl.reshape(x.to(tl.float32), [x.shape[0], ROPE // 2, 2])
    a, b = tl.split(pairs)  # [BLOCK_H, ROPE / 2] each
    out1 = a * cos[None, :] - b * sin[None, :]
    out2 = b * cos[None, :] + a * sin[None, :]
    out = tl.reshape(tl.join(out1, out2), [x.shape[0], ROPE])
    out_ptrs = out_ptr + offs_h[:, None] * stride_oh + offs_r[None, :] * stride_or
    tl.store(out_ptrs, out.to(x.dtype).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, qo_ptr,
    num_heads,
    stride_qt, stride_qh, stride_qr, stride_kt, stride_kr, stride_cs,
    stride_ot, stride_oh, stride_or,
    c_ptr, slot_ptr, cache_ptr, cache16_ptr, cache32_ptr, stride_c, stride_page, stride_row,
    ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    WRITE: tl.constexpr, PAGE_SIZE: tl.constexpr, D_LATENT: tl.constexpr, BLOCK_L: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """WRITE: head-block 0 stores the token's cache row instead of rotating k_pe in place: c_kv,
    then k_pe's rotation, at its slot of a float cache (see write_kv), or with KV_FP8 in the fp8
    row format (see write_kv_fp8; cache_ptr is then the uint8 rows, cache16_ptr / cache32_ptr the
    same bytes as bf16 / fp32, and the cache strides are in bytes)."""
    HALF: tl.constexpr = ROPE // 2
    t = tl.program_id(0)
    hb = tl.program_id(1)
    t64 = t.to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_i).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_i).to(tl.float32)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    q_row, qo_row = q_ptr + t64 * stride_qt, qo_ptr + t64 * stride_ot
    mask_h = offs_h < num_heads
    _rotate(
        q_row, qo_row, offs_h, mask_h, stride_qh, stride_qr, stride_oh, stride_or, cos, sin, ROPE
    )
    if hb == 0:
        offs_k = tl.arange(0, 1)
        k_row = k_ptr + t64 * stride_kt
        if WRITE and KV_FP8:
            row_off = tl.multiple_of(slot_row(slot_ptr, t, stride_page, stride_row, PAGE_SIZE), 16)
            offs_l = tl.arange(0, D_LATENT)
            c8, scale = quantize_row_fp8(tl.load(c_ptr + t64 * stride_c + offs_l), FP8_MAX)
            tl.store(cache_ptr + row_off + offs_l, c8)
            pe_row = cache16_ptr + tl.multiple_of((row_off + D_LATENT) // 2, 8)
            _rotate(k_row, pe_row, offs_k, offs_k < 1, 0, stride_kr, 0, 1, cos, sin, ROPE)
            tl.store(cache32_ptr + (row_off + D_LATENT + 2 * ROPE) // 4, scale)
        elif WRITE:
            row = cache_ptr + slot_row(slot_ptr, t, stride_page, stride_row, PAGE_SIZE)
            offs_l = tl.arange(0, BLOCK_L)
            c = tl.load(c_ptr + t64 * stride_c + offs_l, mask=offs_l < D_LATENT)
            tl.store(row + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < D_LATENT)
            _rotate(k_row, row + D_LATENT, offs_k, offs_k < 1, 0, stride_kr, 0, 1, cos, sin, ROPE)
        else:
            _rotate(k_row, k_row, offs_k, offs_k < 1, 0, stride_kr, 0, stride_kr, cos, sin, ROPE)


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """q_pe: [T, H, R]; k_pe: [T, R] or [T, 1, R]; positions: [T] int; cos_sin: [max_pos, R] fp32.
    In place, or q_pe rotated into q_out; with `cache`, k_pe's rotation goes into the cache rows with
    c_kv, in the same launch (see ref.rope)."""
    if q_pe.dim() != 3 or q_pe.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rope: q_pe must be float [T, H, R], got {q_pe.dtype} {tuple(q_pe.shape)}"
        )
    num_tokens, num_heads, rope_dim = q_pe.shape
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe2 = k_pe[:, 0]
    elif k_pe.dim() == 2:
        k_pe2 = k_pe
    else:
        raise ValueError(f"rope: k_pe must be [T, R] or [T, 1, R], got {tuple(k_pe.shape)}")
    if k_pe2.shape != (num_tokens, rope_dim) or k_pe.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rope: k_pe {k_pe.dtype} {tuple(k_pe.shape)} does not match q_pe "
            f"[T={num_tokens}, R={rope_dim}]"
        )
    if rope_dim < 2 or rope_dim & (rope_dim - 1):
        raise ValueError(f"rope: rope dim R={rope_dim} must be a power of two >= 2")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rope: positions must be int32/int64 [{num_tokens}], got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    if cos_sin.dim() != 2 or cos_sin.shape[1] != rope_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"rope: cos_sin must be fp32 [max_pos, {rope_dim}], got {cos_sin.dtype} "
            f"{tuple(cos_sin.shape)}"
        )
    for name, t in (("k_pe", k_pe), ("positions", positions), ("cos_sin", cos_sin)):
        if t.device != q_pe.device:
            raise ValueError(f"rope: {name} on {t.device}, q_pe on {q_pe.device}")
    if q_out is None:
        q_out = q_pe
    elif q_out.shape != q_pe.shape or q_out.dtype != q_pe.dtype or q_out.device != q_pe.device:
        raise ValueError(
            f"rope: q_out must be {q_pe.dtype} {tuple(q_pe.shape)} on {q_pe.device}, got "
            f"{q_out.dtype} {tuple(q_out.shape)} on {q_out.device}"
        )
    kv_fp8 = cache is not None and cache[0].dtype == torch.uint8
    if cache is not None:
        kv_cache, slots, c_kv = cache
        if kv_fp8:  # the row's bytes, and the same bytes as bf16 (rope) and fp32 (scale)
            c_kv = fp8_cache_inputs(kv_cache, slots, c_kv, k_pe2, "rope")
            views = (kv_cache, kv_cache.view(torch.bfloat16), kv_cache.view(torch.float32))
        else:
            c_kv, _ = float_cache_inputs(kv_cache, slots, c_kv, k_pe2, "rope")
            views = (kv_cache,) * 3
        write = (c_kv, slots, *views, c_kv.stride(0), kv_cache.stride(0), kv_cache.stride(1))
        lora, page_size = c_kv.shape[1], kv_cache.shape[1]
    else:
        write, lora, page_size = (q_pe, positions, q_pe, q_pe, q_pe, 0, 0, 0), 1, 1  # unused
    if num_tokens == 0:
        return
    if cos_sin.stride(1) != 1:
        cos_sin = cos_sin.contiguous()
    cfg = tuning.lookup("rope", f"h={num_heads}", q_pe.device)
    block_h = min(cfg["BLOCK_H"], triton.next_power_of_2(max(num_heads, 1)))
    grid = (num_tokens, max(1, triton.cdiv(num_heads, block_h)))
    _rope_kernel[grid](
        q_pe, k_pe2, positions, cos_sin, q_out,
        num_heads,
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), k_pe2.stride(0), k_pe2.stride(1),
        cos_sin.stride(0), *q_out.stride(), *write,
        ROPE=rope_dim, BLOCK_H=block_h, WRITE=cache is not None,
        PAGE_SIZE=page_size, D_LATENT=lora, KV_FP8=kv_fp8, FP8_MAX=FP8_E4M3_MAX,
        BLOCK_L=triton.next_power_of_2(lora), num_warps=cfg["num_warps"],
    )  # fmt: skip
