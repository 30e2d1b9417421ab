"""noaux_tc expert routing of DeepSeek-V3 (plain torch reference).

Scores are sigmoid(router logits) in fp32. The correction bias is added for *selection only*: each group's score is
the sum of its two best biased scores, the best `topk_group` groups stay, and the `top_k` best biased scores among
their experts are the chosen experts. Weights are the unbiased scores of those experts, renormalised to sum 1 when
`norm_topk_prob`, times `routed_scaling_factor`. Shared experts may ride along as extra columns (`num_shared`).
"""

from __future__ import annotations

import torch


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]; correction_bias: [E]. Returns weights [T, top_k + num_shared] fp32 and ids
    [T, top_k + num_shared] int32. The last num_shared columns are shared experts stacked after the routed
    ones (`fused_moe` over E + num_shared experts): ids E .. E + num_shared - 1, weight 1."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()  # [T, E]
    biased = scores if correction_bias is None else scores + correction_bias.float()
    grouped = biased.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
    kept_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights, ids = weights * routed_scaling_factor, ids.to(torch.int32)
    if num_shared:
        shared = torch.arange(num_experts, num_experts + num_shared, device=ids.device)
        ids = torch.cat([ids, shared.to(torch.int32).expand(num_tokens, -1)], dim=1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], dim=1)
    return weights, ids
