"""RMSNorm (+ residual) on DeepSeek-V3 widths: hidden 7168 (with the residual add, as every layer
runs it), q_lora 1536 and kv_lora 512, for decode batches 1-256 and one prefill-sized 4096 tokens; and
with the output quantized to e4m3 for an fp8 projection (`quant`). Bytes: x (+ residual) read, out (+ new
residual) written, bf16 (out: e4m3 plus one fp32 scale per 128 when quantized). Peer: the torch reference."""

from __future__ import annotations

import torch
from _bench import HBM_BYTES_PER_S, Row, time_ms

from pdserve.kernels.rmsnorm import ref
from pdserve.kernels.rmsnorm import triton as tri

SHAPES = [(1, 7168, True, False), (64, 7168, True, False), (256, 7168, True, False),
          (4096, 7168, True, False), (256, 1536, False, False), (256, 512, False, False),
          (4096, 512, False, False), (1, 7168, True, True), (64, 7168, True, True),
          (64, 1536, False, True)]  # fmt: skip


def run(quick: bool) -> list[Row]:
    rows = []
    for tokens, dim, with_res, quant in SHAPES[::2] if quick else SHAPES:
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x) if with_res else None
        w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
        out_bytes = tokens * dim * (1 + 4 / 128) if quant else tokens * dim * 2
        nbytes = tokens * dim * 2 * (3 if with_res else 1) + out_bytes
        ms = time_ms(lambda x=x, w=w, res=res, q=quant: tri.rmsnorm(x, w, 1e-6, res, q))
        peer_ms = time_ms(lambda x=x, w=w, res=res, q=quant: ref.rmsnorm(x, w, 1e-6, res, q))
        shape = f"T={tokens} D={dim}{' +res' if with_res else ''} bf16{' -> e4m3' if quant else ''}"
        rows.append(Row("rmsnorm", shape, "triton", ms, gbps=nbytes / ms / 1e6,
                        ceiling_frac=nbytes / HBM_BYTES_PER_S * 1e3 / ms,
                        peer="torch ref", peer_ms=peer_ms))  # fmt: skip
    return rows
