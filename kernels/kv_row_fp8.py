"""The fp8 latent-cache row format, shared by the ops that write or read an fp8 cache (mla_decode,
rope) and by the model's cache layout: the row's layout and its plain-torch codec
(`quantize_kv_fp8` / `dequantize_kv_fp8`, the spec the Triton writers and readers follow).

An fp8 cache is a uint8 tensor [num_pages, page_size, row_bytes]; one row holds one token's
cache entry, by byte offset:

    [0, L)              c_kv in float8_e4m3fn: round_to_nearest_even(c_kv / scale)
    [L, L + 2R)         k_pe in bfloat16, unquantized (the rope dims would lose too much in fp8)
    [L + 2R, L + 2R + 4) scale, float32: max(|c_kv|) / 448 correctly rounded (1.0 for a zero row)
    then padding up to a multiple of 16 bytes (zeros from the reference writer, never read)

where L = kv_lora_rank and R = rope dims. c_kv is recovered as float(c_kv_fp8) * scale. For
DeepSeek-V3 (L = 512, R = 64) a row is 656 bytes against 1152 in bf16 (0.57x). Every part starts
16-byte aligned (L is a power of two >= 16) and rows are a multiple of 16 bytes, so the kernels read
every part with 16-byte loads.
"""

from __future__ import annotations

import torch

from .fp8_quant import FP8_E4M3_MAX

ROW_ALIGN_BYTES = 16


def rope_offset(kv_lora_rank: int) -> int:
    """Byte offset of k_pe (bf16) in a row."""
    return kv_lora_rank


def scale_offset(kv_lora_rank: int, rope_dim: int) -> int:
    """Byte offset of the fp32 scale in a row."""
    return kv_lora_rank + 2 * rope_dim


def row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8 cache row."""
    used = scale_offset(kv_lora_rank, rope_dim) + 4
    return -(-used // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


def quantize_kv_fp8(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """c_kv: [T, L]; k_pe: [T, R] (any float dtype). Returns [T, row_bytes] uint8 rows in the fp8
    format."""
    num_tokens, lora = c_kv.shape
    rope = k_pe.shape[-1]
    c = c_kv.float()
    amax = c.abs().amax(dim=-1, keepdim=True)  # [T, 1]
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which
    # is not the correctly rounded quotient the format (and the Triton writer) uses
    fp8_max = torch.full_like(amax, FP8_E4M3_MAX)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    c8 = (c / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    c8 = c8.to(torch.float8_e4m3fn)
    rows = torch.zeros(num_tokens, row_bytes(lora, rope), dtype=torch.uint8, device=c_kv.device)
    rows[:, :lora] = c8.view(torch.uint8)
    rope_at, scale_at = rope_offset(lora), scale_offset(lora, rope)
    rows[:, rope_at:scale_at] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    rows[:, scale_at : scale_at + 4] = scale.view(torch.uint8)
    return rows


def dequantize_kv_fp8(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> torch.Tensor:
    """rows: [..., row_bytes] uint8, fp8 format. Returns fp32 [..., kv_lora_rank + rope_dim]."""
    lora = kv_lora_rank
    rope_at, scale_at = rope_offset(lora), scale_offset(lora, rope_dim)
    rows = rows.contiguous()
    c = rows[..., :lora].view(torch.float8_e4m3fn).float()
    k_pe = rows[..., rope_at:scale_at].contiguous().view(torch.bfloat16).float()
    scale = rows[..., scale_at : scale_at + 4].contiguous().view(torch.float32)
    return torch.cat([c * scale, k_pe], dim=-1)


__all__ = [
    "FP8_E4M3_MAX",
    "ROW_ALIGN_BYTES",
    "dequantize_kv_fp8",
    "quantize_kv_fp8",
    "row_bytes",
    "rope_offset",
    "scale_offset",
]
