"""Fused MoE over the routed experts (plain torch reference).

Expert e computes down(silu(gate(x)) * up(x)) with w13[e] = [gate; up] stacked along the output dim and w2[e] the
down projection. Each token's output is the sum over its top-k experts of weight * expert(x). With fp8 weights
(`w13_scale_inv`, `w2_scale_inv` given) the activations entering each GEMM are quantized in 1x128 groups, as the
FP8 GEMM does. Accumulation is fp32; the result has x's dtype.

`tree=(groups, group_size)` sums each token's expert outputs in an order no expert-parallel layout changes: the
experts fall into `groups` groups of `group_size` consecutive ids (ids beyond them: none), each group's
outputs are added in slot order, then the groups as a balanced binary tree (neighbours first), in fp32, and the
result stays fp32. A rank holding `groups / N` consecutive groups of a model's `groups` computes a subtree, and
the ranks' subtrees added as the tree's top levels give the very bits of one rank holding all experts
(`pdserve.model.expert_exchange`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_gemm.ref import fp8_gemm, scaled_gemm
from ..fp8_quant import check_quantized_act


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None):
    if scale_inv is None:
        return x.float() @ w.float().t()
    return fp8_gemm(x.float(), w, scale_inv)


def check_x_q(x: torch.Tensor, x_q: tuple[torch.Tensor, torch.Tensor] | None, fp8: bool) -> None:
    """x_q, where given, is x quantized for fp8 weights: (x_fp8 [T, D] e4m3 on x's device, scales
    [T, ceil(D/128)] fp32)."""
    if x_q is None:
        return
    if not fp8:
        raise ValueError(
            "fused_moe: x_q (x quantized) is for fp8 weights; these weights are not fp8"
        )
    x_fp8, x_scales = x_q
    check_quantized_act(x_fp8, x_scales)
    if x_fp8.shape != x.shape or x_fp8.device != x.device or x_scales.device != x.device:
        raise ValueError(
            f"fused_moe: x_q must be x {tuple(x.shape)} quantized on {x.device}, got "
            f"{tuple(x_fp8.shape)} on {x_fp8.device} (scales on {x_scales.device})"
        )


def check_tree(tree: tuple[int, int] | None) -> None:
    if tree is None:
        return
    groups, group_size = tree
    if groups not in (1, 2, 4, 8, 16) or group_size < 1:
        raise ValueError(
            f"fused_moe: tree={tree}: expected (groups in 1/2/4/8/16, experts per group >= 1)"
        )


def tree_sum(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The balanced binary tree sum of `parts` along `dim` (a power-of-two length), neighbours first."""
    while parts.shape[dim] > 1:
        parts = parts.unflatten(dim, (-1, 2)).sum(dim + 1)
    return parts.squeeze(dim)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I]; topk_weights: [T, k] fp32; topk_ids: [T, k] int.

    Scales (fp8 only): w13_scale_inv [E, ceil(2I/128), ceil(D/128)], w2_scale_inv [E, ceil(D/128), ceil(I/128)].
    x_q (fp8 only): x already quantized in 1x128 groups, (x_fp8, scales [T, ceil(D/128)], any strides), as
    `quantize_act` or `rmsnorm(quant=...)` return it; the gate/up GEMM then takes it instead of quantizing x.
    An id outside [0, E) contributes nothing (used for experts owned by another rank). tree: see the module
    docstring (then fp32). Returns [T, D].
    """
    check_x_q(x, x_q, w13_scale_inv is not None)
    check_tree(tree)
    num_experts, inter2 = w13.shape[0], w13.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    contributions = None
    if tree is not None:  # each (token, slot)'s weighted output, summed below in the tree's order
        contributions = torch.zeros(topk_ids.numel(), x.shape[1], device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < num_experts:
            continue
        rows = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of[rows]
        if x_q is None:
            h = _expert_linear(
                x[tokens], w13[e], None if w13_scale_inv is None else w13_scale_inv[e]
            )
        else:
            h = scaled_gemm(x_q[0][tokens], x_q[1][tokens], w13[e], w13_scale_inv[e], torch.float32)
        act = F.silu(h[:, : inter2 // 2]) * h[:, inter2 // 2 :]  # [n, I]
        y = _expert_linear(act, w2[e], None if w2_scale_inv is None else w2_scale_inv[e])
        if contributions is not None:
            contributions[rows] = y.float() * flat_weights[rows, None]
        else:
            out.index_add_(0, tokens, y.float() * flat_weights[rows, None])
    if contributions is None:
        return out.to(x.dtype)
    groups, group_size = tree
    k = topk_ids.shape[1]
    parts = torch.zeros(x.shape[0], groups, x.shape[1], dtype=torch.float32, device=x.device)
    group_of = topk_ids.long() // group_size  # [T, k]
    by_slot = contributions.view(x.shape[0], k, x.shape[1])
    for j in range(k):  # slot order within a group
        hit = (group_of[:, j] >= 0) & (group_of[:, j] < groups)
        t = hit.nonzero().squeeze(1)
        parts[t, group_of[t, j]] += by_slot[t, j]
    return tree_sum(parts, 1)
