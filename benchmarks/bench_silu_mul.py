"""silu_mul (SwiGLU's activation) on DeepSeek-V3 widths: the dense FFN (I = 18432) and the shared expert
(I = 2048), decode batches 1 and 64 and a 4096-token prefill; bf16 out, and quantized to e4m3 for the fp8
down projection. Bytes: gate and up read (bf16), the output written (bf16, or e4m3 plus one fp32 scale
per 128). Peer: what the model ran before, torch's `F.silu(gate) * up` (then `quantize_act` for fp8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bench import HBM_BYTES_PER_S, Row, time_graph_ms

from pdserve.kernels.fp8_gemm import triton as fp8
from pdserve.kernels.silu_mul import triton as tri

SHAPES = [(1, 18432), (64, 18432), (4096, 18432), (1, 2048), (64, 2048)]


def run(quick: bool) -> list[Row]:
    rows = []
    for tokens, inter in SHAPES[:2] if quick else SHAPES:
        both = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
        gate, up = both[:, :inter], both[:, inter:]
        for quant in (False, True):
            out_bytes = tokens * inter * (1 + 4 / 128 if quant else 2)
            nbytes = tokens * inter * 4 + out_bytes
            ms = time_graph_ms(lambda g=gate, u=up, q=quant: tri.silu_mul(g, u, q))
            if quant:
                peer_ms = time_graph_ms(lambda g=gate, u=up: fp8.quantize_act(F.silu(g) * u))
            else:
                peer_ms = time_graph_ms(lambda g=gate, u=up: F.silu(g) * u)
            shape = f"T={tokens} I={inter} bf16{' -> e4m3' if quant else ''}"
            rows.append(Row("silu_mul", shape, "triton (graph)", ms, gbps=nbytes / ms / 1e6,
                            ceiling_frac=nbytes / HBM_BYTES_PER_S * 1e3 / ms,
                            peer="torch (graph)", peer_ms=peer_ms))  # fmt: skip
    return rows
