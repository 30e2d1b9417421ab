"""Fused MoE over the routed experts (plain torch reference).

Expert e computes down(silu(gate(x)) * up(x)) with w13[e] = [gate; up] stacked along the output dim and w2[e] the
down projection. Each token's output is the sum over its top-k experts of weight * expert(x). With fp8 weights
(`w13_scale_inv`, `w2_scale_inv` given) the activations entering each GEMM are quantized in 1x128 groups, as the
FP8 GEMM does. Accumulation is fp32; the result has x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_gemm.ref import fp8_gemm


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None):
    if scale_inv is None:
        return x.float() @ w.float().t()
    return fp8_gemm(x.float(), w, scale_inv)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I]; topk_weights: [T, k] fp32; topk_ids: [T, k] int.

    Scales (fp8 only): w13_scale_inv [E, ceil(2I/128), ceil(D/128)], w2_scale_inv [E, ceil(D/128), ceil(I/128)].
    An id outside [0, E) contributes nothing (used for experts owned by another rank). Returns [T, D].
    """
    num_experts, inter2 = w13.shape[0], w13.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < num_experts:
            continue
        rows = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of[rows]
        h = _expert_linear(x[tokens], w13[e], None if w13_scale_inv is None else w13_scale_inv[e])
        act = F.silu(h[:, : inter2 // 2]) * h[:, inter2 // 2 :]  # [n, I]
        y = _expert_linear(act, w2[e], None if w2_scale_inv is None else w2_scale_inv[e])
        out.index_add_(0, tokens, y.float() * flat_weights[rows, None])
    return out.to(x.dtype)
