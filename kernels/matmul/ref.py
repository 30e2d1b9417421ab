"""Dense matmuls of the model, in plain torch (cuBLAS on a GPU): the spec of the Triton kernels.

`linear(x, w)`: x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (w must have x's dtype).
`head_matmul(x, w)`: per head h, x[:, h] @ w[h]: x [T, H, K], w [H, K, N] (any strides) -> [T, H, N]. With
`quant=True` (N a multiple of 128) that product, in x's dtype, comes quantized for an fp8 projection:
`fp8_gemm.quantize_act` of it as [T, H * N], i.e. (out_fp8 [T, H * N], scales [T, H * N / 128]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_gemm.ref import ACT_QUANT_GROUP, quantize_act


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def head_matmul(x: torch.Tensor, w: torch.Tensor, quant: bool = False):
    out = torch.einsum("thk,hkn->thn", x, w)
    if not quant:
        return out
    if out.shape[-1] % ACT_QUANT_GROUP:
        raise ValueError(
            f"head_matmul: quant needs N a multiple of {ACT_QUANT_GROUP}, got {out.shape[-1]}"
        )
    return quantize_act(out.reshape(out.shape[0], -1))
