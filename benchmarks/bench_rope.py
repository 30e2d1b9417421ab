"""Interleaved RoPE in place on DeepSeek-V3's rope dims (64): q_pe as the model passes it (the
strided rope slice of q [T, H, 192]) and k_pe [T, 64], 16 and 128 heads, batches 1-4096, bf16.
Bytes: q_pe and k_pe read and written, cos/sin rows read. Peer: the torch reference."""

from __future__ import annotations

import torch
from _bench import HBM_BYTES_PER_S, Row, time_ms

from pdserve.kernels.rope import ref
from pdserve.kernels.rope import triton as tri

SHAPES = [(1, 16), (256, 16), (1, 128), (256, 128), (4096, 128)]


def run(quick: bool) -> list[Row]:
    rows = []
    cos_sin = torch.randn(163840, 64, device="cuda")
    for tokens, heads in SHAPES[1::2] if quick else SHAPES:
        q = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
        q_pe = q.split([128, 64], -1)[1]
        k_pe = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 163840, (tokens,), device="cuda")
        nbytes = tokens * (heads + 1) * 64 * 2 * 2 + tokens * 64 * 4
        ms = time_ms(lambda q_pe=q_pe, k_pe=k_pe, pos=pos: tri.rope(q_pe, k_pe, pos, cos_sin))
        peer_ms = time_ms(lambda q_pe=q_pe, k_pe=k_pe, pos=pos: ref.rope(q_pe, k_pe, pos, cos_sin))
        rows.append(Row("rope", f"T={tokens} H={heads} R=64 bf16", "triton", ms,
                        gbps=nbytes / ms / 1e6, ceiling_frac=nbytes / HBM_BYTES_PER_S * 1e3 / ms,
                        peer="torch ref", peer_ms=peer_ms))  # fmt: skip
    return rows
