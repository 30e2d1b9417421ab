"""RMSNorm reference (plain torch): the spec the Triton kernel must match.

Normalises in fp32, casts back to the input dtype, then scales by `weight` (the order HF transformers and the
DeepSeek reference use). With `residual`, first adds it: the sum is both normalised and returned as the new residual.
The residual may be fp32 while x is bf16/fp16 (the model keeps its residual stream in fp32): the sum is formed in
fp32, kept in the residual's dtype, and the output is in x's dtype.

With `quant`, the output (rounded to x's dtype as above) comes quantized to e4m3 in 1x128 groups exactly as
`fp8_gemm.quantize_act` does, for an fp8 projection that takes it as it is (`fp8_gemm.scaled_gemm`). With
quant="both", it comes both ways, for readers of each kind (an MoE layer: the router takes the output, fp8
experts, routed and shared, the quantized one; the Triton kernel lays those scales out row-major).
"""

from __future__ import annotations

import torch

from ..fp8_quant import quantize_act


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: bool | str = False,
):
    """x, residual: [T, D]; weight: [D]. Returns out [T, D] in x's dtype, or (out, x + residual) when residual is
    given (the sum in the residual's dtype). With `quant`, out is the pair (out_fp8 [T, D] e4m3, scales
    [T, ceil(D/128)] fp32); x must then be 2-D. With quant="both", out is (out, (out_fp8, scales))."""
    check_quant(quant)
    if residual is not None:
        residual = (x.float() + residual.float()).to(residual.dtype)
        h = residual.float()
    else:
        h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * h.to(x.dtype)).to(x.dtype)
    if quant:
        if out.dim() != 2:
            raise ValueError(f"rmsnorm: quant needs x [T, D], got {tuple(x.shape)}")
        out = (out, quantize_act(out)) if quant == "both" else quantize_act(out)
    return out if residual is None else (out, residual)


def check_quant(quant: bool | str) -> None:
    if quant not in (False, True, "both"):
        raise ValueError(f"rmsnorm: quant must be False, True or 'both', got {quant!r}")
