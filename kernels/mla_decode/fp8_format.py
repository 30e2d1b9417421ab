"""The fp8 latent-cache row format shared by `ref.py` and `triton.py`.

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

FP8_E4M3_MAX = 448.0
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
