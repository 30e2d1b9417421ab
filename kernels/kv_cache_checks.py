"""The input checks of the latent-cache writers (mla_decode's write_kv / write_kv_fp8, and rope
when it stores the rotated k_pe there) and of an fp8 cache's shape, shared by their Triton
launchers. Each raises ValueError naming the op and the bad input."""

from __future__ import annotations

import torch

from .kv_row_fp8 import row_bytes

_INT_DTYPES = (torch.int32, torch.int64)


def float_cache_inputs(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks of a write of [c_kv | k_pe] rows into a float cache [P, S, L + R] (write_kv, and rope
    when it stores the rotated k_pe there); returns c_kv and k_pe with unit last stride."""
    if kv_cache.dim() != 3 or kv_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"{op}: kv_cache must be a float [P, S, L + R] cache (write_kv_fp8 writes the fp8 "
            f"one), got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    c_kv, k_pe = _write_inputs(kv_cache, slots, c_kv, k_pe, op)
    lora, rope = c_kv.shape[1], k_pe.shape[1]
    if kv_cache.shape[2] != lora + rope or kv_cache.stride(2) != 1:
        raise ValueError(
            f"{op}: cache rows of {kv_cache.shape[2]} (unit stride) expected L + R = {lora + rope}"
        )
    return c_kv, k_pe


def fp8_cache_inputs(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, op: str
) -> torch.Tensor:
    """The checks of a write of [c_kv | k_pe] rows into an fp8 cache [P, S, row_bytes] uint8
    (write_kv_fp8, and rope when it stores the rotated k_pe there); returns c_kv with unit last
    stride."""
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8:
        raise ValueError(
            f"{op}: kv_cache must be uint8 [P, S, row_bytes], got {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)}"
        )
    c_kv, k_pe = _write_inputs(kv_cache, slots, c_kv, k_pe, op)
    lora, rope = c_kv.shape[1], k_pe.shape[1]
    check_kv_dims(lora, rope, op)
    check_fp8_cache(kv_cache, lora, rope, op)
    return c_kv


def _write_inputs(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache writer's checks of c_kv [T, L], k_pe [T, R] and slots [T] int, all on the cache's
    device; returns c_kv and k_pe with unit last stride (views when they have it)."""
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"{op}: c_kv [T, L] and k_pe [T, R] expected, got {tuple(c_kv.shape)}, "
            f"{tuple(k_pe.shape)}"
        )
    if slots.shape != (c_kv.shape[0],) or slots.dtype not in _INT_DTYPES:
        raise ValueError(f"{op}: slots must be int [{c_kv.shape[0]}], got {slots.dtype}")
    for name, t in (("slots", slots), ("c_kv", c_kv), ("k_pe", k_pe)):
        if t.device != kv_cache.device:
            raise ValueError(f"{op}: {name} on {t.device}, kv_cache on {kv_cache.device}")
    c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    return c_kv, k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()


def check_kv_dims(lora: int, rope: int, op: str) -> None:
    """kv_lora_rank and the rope dims are powers of two >= 16 (what the kernels' tiles need)."""
    for name, d in (("kv_lora_rank", lora), ("rope dims", rope)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{op}: {name}={d} must be a power of two >= 16")


def check_fp8_cache(kv_cache: torch.Tensor, lora: int, rope: int, op: str) -> None:
    """kv_cache holds `kv_row_fp8` rows for (lora, rope), with 16-byte aligned start and strides."""
    want = row_bytes(lora, rope)
    if kv_cache.shape[-1] != want:
        raise ValueError(
            f"{op}: fp8 cache rows are {kv_cache.shape[-1]} bytes, the format needs {want} "
            f"(kv_lora_rank={lora}, rope={rope})"
        )
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16:
        raise ValueError(
            f"{op}: fp8 cache strides {kv_cache.stride()} must be multiples of 16 bytes"
        )
    if kv_cache.data_ptr() % 16:
        raise ValueError(f"{op}: fp8 cache must start 16-byte aligned")


__all__ = ["check_fp8_cache", "check_kv_dims", "float_cache_inputs", "fp8_cache_inputs"]
