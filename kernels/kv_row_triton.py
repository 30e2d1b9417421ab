"""Triton helpers of the latent-cache writers (mla_decode's write kernels and rope's fused cache
write): a token's slot to its row's address, and one row's latent quantized into the fp8 format of
`kv_row_fp8` (the same arithmetic as `kv_row_fp8.quantize_kv_fp8`)."""

import triton
import triton.language as tl


@triton.jit
def slot_row(slot_ptr, t, stride_page, stride_row, PAGE_SIZE: tl.constexpr):
    """Offset (in elements of the cache's pointer) of the row of token t's slot, page * PAGE_SIZE +
    row, in a cache [P, PAGE_SIZE, W] with any page stride: the cache writers' addressing."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    return (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_row


@triton.jit
def quantize_row_fp8(c, FP8_MAX: tl.constexpr):
    """One cache row's latent [L] in the fp8 format: (e4m3 bytes as uint8 [L], fp32 scale)."""
    c = c.to(tl.float32)
    amax = tl.max(tl.abs(c), 0)
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    c8 = tl.clamp(tl.math.div_rn(c, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return c8.to(tl.uint8, bitcast=True), scale


__all__ = ["quantize_row_fp8", "slot_row"]
