"""Rotary position embedding on interleaved pairs, applied in place (plain torch reference).

The DeepSeek checkpoints rotate consecutive pairs (x[2i], x[2i+1]) by angle pos * inv_freq[i]. The layout stays
interleaved after rotation: only dot products between rotated q and k matter, and both sides use the same layout.
`cos_sin` holds, per position, the R/2 cosines followed by the R/2 sines (YaRN's attention factor already folded in).
"""

from __future__ import annotations

import torch

from ..mla_decode.ref import write_kv, write_kv_fp8


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """q_pe: [T, H, R]; k_pe: [T, R] or [T, 1, R]; positions: [T] int; cos_sin: [max_pos, R] fp32. In place;
    with `q_out` ([T, H, R] of q_pe's dtype, any strides), rotated q_pe goes there and q_pe is left as it was
    (the absorbed decode query takes it beside the latent part). With `cache` = (kv_cache, slots, c_kv), k_pe
    is left as it was and each token's [c_kv | rotated k_pe] is stored at its slot of the cache, as
    `mla_decode.write_kv` stores it in a float cache and `write_kv_fp8` in an fp8 one (uint8 rows)
    (decode: the rotation and the cache write in one launch)."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions.long()].float()  # [T, R]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, R/2]
    if cache is not None:
        k_pe = k_pe.clone()
    k3 = k_pe.view(k_pe.shape[0], -1, k_pe.shape[-1])
    for x, out in ((q_pe, q_pe if q_out is None else q_out), (k3, k3)):
        x1 = x[..., 0::2].float()  # [T, H, R/2]; a view when x is fp32: compute both halves first
        x2 = x[..., 1::2].float()
        out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out[..., 0::2] = out1.to(x.dtype)
        out[..., 1::2] = out2.to(x.dtype)
    if cache is not None:
        kv_cache, slots, c_kv = cache
        write = write_kv_fp8 if kv_cache.dtype == torch.uint8 else write_kv
        write(kv_cache, slots, c_kv, k_pe.view(k_pe.shape[0], -1))
