"""noaux_tc routing for 1-8192 tokens: DeepSeek-V3 (256 experts, 8 groups, 4 kept, top-8) and
V2-Lite- shaped (64 experts, top-6), the Triton kernel against the torch reference on the same
GPU. GB/s counts the fp32 logits read and the weights and ids written once."""

from __future__ import annotations

import torch
from _bench import HBM_BYTES_PER_S, Row, time_ms

SHAPES = {"v3": (256, 8, 4, 8, True, 2.5, True), "v2-lite": (64, 1, 1, 6, False, 1.0, False)}


def run(quick: bool) -> list[Row]:
    from pdserve.kernels.moe_route import ref
    from pdserve.kernels.moe_route import triton as tri

    cases = [("v3", t) for t in ((1, 8192) if quick else (1, 64, 1024, 8192))]
    cases.append(("v2-lite", 8192))
    rows = []
    for shape, tokens in cases:
        experts, n_group, topk_group, top_k, has_bias, scale, norm = SHAPES[shape]
        logits = torch.randn(tokens, experts, device="cuda")
        bias = torch.randn(experts, device="cuda") * 0.3 if has_bias else None
        args = (logits, bias, top_k, n_group, topk_group, scale, norm)
        ms = time_ms(lambda: tri.moe_route(*args))  # noqa: B023
        gbps = (tokens * experts * 4 + tokens * top_k * 8) / ms / 1e6
        rows.append(Row("moe_route", f"{shape} t{tokens}", "triton", ms, gbps=gbps,
                        ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S, peer="torch ref",
                        peer_ms=time_ms(lambda: ref.moe_route(*args))))  # noqa: B023  # fmt: skip
    return rows
