"""noaux_tc expert routing in Triton: one program routes BLOCK_T tokens, holding their [BLOCK_T, E]
scores.

Same contract as `ref.moe_route`. Per token: scores = sigmoid(logits) in fp32; biased = scores +
bias (selection only); each group's score is the sum of its two best biased scores; a group is kept
when fewer than `topk_group` groups beat it (a better score, or an equal score and a lower group
id); the top_k best biased scores among the kept groups' experts are chosen one at a time (lowest
expert id first on ties), so ids come out in descending biased score. Weights are the unbiased
scores of the chosen experts, renormalised when `norm_topk_prob`, times `routed_scaling_factor`. Any
expert count works (padded to a power of two); groups need not be a power of two wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import lookup

_empty = torch.empty
"""Output allocator; tests replace it to poison outputs before the kernel writes them."""


@triton.jit
def _moe_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_t, scale,
    NUM_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, N_SHARED: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    GROUP_SIZE: tl.constexpr = NUM_EXPERTS // N_GROUP
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_ok = tokens < num_tokens
    expert_ok = experts < NUM_EXPERTS
    ptrs = logits_ptr + tokens.to(tl.int64)[:, None] * stride_t + experts[None, :]
    x = tl.load(ptrs, mask=token_ok[:, None] & expert_ok[None, :], other=0.0).to(tl.float32)
    scores = tl.sigmoid(x)  # [BT, BE]
    if HAS_BIAS:
        biased = (
            scores + tl.load(bias_ptr + experts, mask=expert_ok, other=0.0).to(tl.float32)[None, :]
        )
    else:
        biased = scores
    biased = tl.where(expert_ok[None, :], biased, float("-inf"))
    group_of = experts // GROUP_SIZE  # [BE]

    if N_GROUP > 1:
        # group score = sum of the two best biased scores of the group
        groups = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            member = (group_of == g)[None, :]
            in_group = tl.where(member, biased, float("-inf"))
            first = tl.max(in_group, 1)
            first_id = tl.min(
                tl.where(member & (in_group == first[:, None]), experts[None, :], BLOCK_E), 1
            )
            if GROUP_SIZE > 1:
                second = tl.max(
                    tl.where(experts[None, :] == first_id[:, None], float("-inf"), in_group), 1
                )
                score = first + second
            else:
                score = first
            group_scores = tl.where(groups[None, :] == g, score[:, None], group_scores)
        # keep a group when fewer than TOPK_GROUP groups beat it; mask out the others' experts
        for g in tl.static_range(N_GROUP):
            mine = tl.sum(tl.where(groups[None, :] == g, group_scores, 0.0), 1)  # [BT]
            beats = (group_scores > mine[:, None]) | (
                (group_scores == mine[:, None]) & (groups < g)[None, :]
            )
            dropped = tl.sum(beats.to(tl.int32), 1) >= TOPK_GROUP  # [BT]
            biased = tl.where(dropped[:, None] & (group_of == g)[None, :], float("-inf"), biased)

    slots = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    chosen_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(biased, 1)
        best_id = tl.min(tl.where(biased == best[:, None], experts[None, :], BLOCK_E), 1)  # [BT]
        picked = experts[None, :] == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), 1)
        chosen_ids = tl.where(slots[None, :] == i, best_id[:, None], chosen_ids)
        chosen_w = tl.where(slots[None, :] == i, weight[:, None], chosen_w)
        biased = tl.where(picked, float("-inf"), biased)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, 1)[:, None] + 1e-20)
    chosen_w = chosen_w * scale
    if N_SHARED > 0:  # shared experts stacked after the routed ones, weight 1
        shared = (slots >= TOP_K)[None, :]
        chosen_ids = tl.where(shared, NUM_EXPERTS + slots[None, :] - TOP_K, chosen_ids)
        chosen_w = tl.where(shared, 1.0, chosen_w)
    out_mask = token_ok[:, None] & (slots < TOP_K + N_SHARED)[None, :]
    out_offs = tokens.to(tl.int64)[:, None] * (TOP_K + N_SHARED) + slots[None, :]
    tl.store(weights_ptr + out_offs, chosen_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, chosen_ids, mask=out_mask)


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
    """See `ref.moe_route`. Returns weights [T, top_k + num_shared] fp32 and ids [T, top_k +
    num_shared] int32, routed ids in descending biased score (ties: lower expert id first), then the
    shared experts E .. E + num_shared - 1 with weight 1."""
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise ValueError(
            f"router_logits must be a float [T, E] tensor, got {router_logits.dtype} "
            f"{tuple(router_logits.shape)}"
        )
    if router_logits.stride(-1) != 1:
        raise ValueError(
            f"router_logits must be contiguous in the expert dim, got {router_logits.stride()}"
        )
    num_tokens, num_experts = router_logits.shape
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} must be >= 1 and divide the {num_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k={top_k} must be in [1, {topk_group * (num_experts // n_group)}] "
            f"(topk_group={topk_group} groups of {num_experts // n_group} experts)"
        )
    if num_shared < 0:
        raise ValueError(f"num_shared={num_shared} must be >= 0")
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise ValueError(
                f"correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}"
            )
        if correction_bias.device != router_logits.device:
            raise ValueError(
                f"correction_bias is on {correction_bias.device}, logits on {router_logits.device}"
            )
        correction_bias = correction_bias.contiguous()
    cols = top_k + num_shared
    weights = _empty(num_tokens, cols, dtype=torch.float32, device=router_logits.device)
    ids = _empty(num_tokens, cols, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    cfg = lookup("moe_route", f"experts={block_e}", router_logits.device)
    block_t = cfg["BLOCK_T"]
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, correction_bias if correction_bias is not None else router_logits,
        weights, ids, num_tokens, router_logits.stride(0), float(routed_scaling_factor),
        NUM_EXPERTS=num_experts, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        N_SHARED=num_shared,
        HAS_BIAS=correction_bias is not None, NORMALIZE=bool(norm_topk_prob),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_K=triton.next_power_of_2(cols), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return weights, ids
