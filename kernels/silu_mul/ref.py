"""SwiGLU's activation (plain torch reference): silu(gate) * up, optionally quantized for an fp8 GEMM.

The product is computed in fp32 and rounded once to gate's dtype. With `quant`, that rounded value is quantized
to e4m3 in 1x128 groups along the last dim exactly as `fp8_gemm.quantize_act` does, so the fp8 down projection
that follows can take it as it is (`fp8_gemm.scaled_gemm`) instead of quantizing it in a launch of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_quant import quantize_act

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    """gate and up: the same 2-D float shape, dtype and device, unit stride along the last dim."""
    if gate.dim() != 2 or gate.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"silu_mul: gate must be a 2-D float tensor, got {gate.dtype} {tuple(gate.shape)}"
        )
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(
            f"silu_mul: up must match gate ({gate.dtype} {tuple(gate.shape)} on {gate.device}), "
            f"got {up.dtype} {tuple(up.shape)} on {up.device}"
        )
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul: gate and up need unit stride along the last dim")


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, quant: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """gate, up: [T, I] (rows may have any stride). Returns silu(gate) * up [T, I] in gate's dtype, or with
    `quant` (x_fp8 [T, I] float8_e4m3fn, scales [T, ceil(I/128)] fp32) of that value."""
    check_inputs(gate, up)
    out = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return quantize_act(out) if quant else out
