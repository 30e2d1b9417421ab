"""W_UV's per-head product in the absorbed MLA decode (128 heads, [T, 128, 512] @ [128, 512, 128], bf16),
quantized for the fp8 o projection: `head_matmul(quant=True)` (one Triton kernel) against what the model
runs without it, torch's einsum (cuBLAS) and then `quantize_act`. Bytes: the latent rows and W_UV read,
the e4m3 output and its scales written. The "+ o" rows time the product and the fp8 o projection
(16384 -> 7168) together, as the decode step runs them: ours then `scaled_gemm`, against einsum then
`fp8_gemm` (which quantizes inside or beforehand); GB/s counts o's weight too. One-call CUDA graphs."""

from __future__ import annotations

import torch
from _bench import HBM_BYTES_PER_S, Row, time_graph_ms

from pdserve.kernels.fp8_gemm import ref as fp8_ref
from pdserve.kernels.fp8_gemm import triton as fp8
from pdserve.kernels.matmul import ref
from pdserve.kernels.matmul import triton as tri

HEADS, LATENT, V, HIDDEN = 128, 512, 128, 7168


def run(quick: bool) -> list[Row]:
    rows = []
    w = (torch.randn(HEADS, 2 * V, LATENT, device="cuda") / LATENT**0.5).bfloat16()
    w_uv = w[:, V:].transpose(1, 2)  # [H, 512, 128], the strided view the model passes
    wo, wo_s = fp8_ref.quantize_weight(torch.randn(HIDDEN, HEADS * V, device="cuda") * 0.02)
    for tokens in (1, 64) if quick else (1, 16, 64, 128):
        x = torch.randn(tokens, HEADS, LATENT, device="cuda").bfloat16()
        nbytes = (x.numel() + HEADS * LATENT * V) * 2 + tokens * HEADS * V * (1 + 4 / 128)
        ms = time_graph_ms(lambda x=x: tri.head_matmul(x, w_uv, quant=True))
        peer_ms = time_graph_ms(
            lambda x=x, t=tokens: fp8.quantize_act(ref.head_matmul(x, w_uv).reshape(t, -1))
        )
        rows.append(Row("head_matmul", f"W_UV T={tokens} H={HEADS} -> e4m3", "triton (graph)", ms,
                        gbps=nbytes / ms / 1e6, ceiling_frac=nbytes / HBM_BYTES_PER_S * 1e3 / ms,
                        peer="einsum + quantize_act (graph)", peer_ms=peer_ms))  # fmt: skip
        ms = time_graph_ms(
            lambda x=x: fp8.scaled_gemm(*tri.head_matmul(x, w_uv, quant=True), wo, wo_s)
        )
        peer_ms = time_graph_ms(
            lambda x=x, t=tokens: fp8.fp8_gemm(ref.head_matmul(x, w_uv).reshape(t, -1), wo, wo_s)
        )
        nbytes += wo.numel() + wo_s.numel() * 4
        rows.append(Row("head_matmul", f"W_UV T={tokens} H={HEADS} + o", "triton (graph)", ms,
                        gbps=nbytes / ms / 1e6, ceiling_frac=nbytes / HBM_BYTES_PER_S * 1e3 / ms,
                        peer="einsum + fp8_gemm(o) (graph)", peer_ms=peer_ms))  # fmt: skip
    return rows
