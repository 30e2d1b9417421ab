"""Expert-parallel MoE: moving tokens to the ranks that hold their routed experts and the outputs back.

`ExpertExchange` is the one interface; `AllToAllExchange` (ranks with different tokens: data-parallel attention)
and `AllReduceExchange` (every rank the same tokens: tensor-parallel attention) implement it on plain
torch.distributed collectives, so they run on gloo (CPU) and NCCL alike.

Batch invariance: every row of the local batch is one (token, top-k slot) pair and goes through one expert on its
own; the expert outputs are weighted in fp32 and summed per token in top-k slot order on the token's home rank
(`weighted_sum_in_slot_order`). So a token's output does not depend on which tokens travel with it or where they
sit; only the expert GEMMs themselves must be batch-invariant (the kernels' batch-invariant mode).
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.distributed as dist

from .parallel import ParallelLayout


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertBatch:
    """The rows this rank's experts compute in one MoE layer: row i is `x[i]` through local expert
    `expert_ids[i]`, unweighted (the weight is applied on the token's home rank)."""

    x: torch.Tensor  # [R, D] in the activation dtype
    expert_ids: torch.Tensor  # [R] int64, local ids in [0, experts per rank)

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]


class ExpertExchange(abc.ABC):
    """Dispatch and combine for one MoE layer over the ranks of an expert-parallel group.

    Contract, per MoE layer and step:
    - every rank of the group calls `dispatch` then `combine`, in the same layer order, also with zero tokens
      (T = 0): both are collective;
    - `dispatch(x, topk_ids, topk_weights)`: x [T, D] this rank's tokens, topk_ids [T, k] global expert ids,
      topk_weights [T, k] fp32. Returns the `ExpertBatch` this rank's experts must compute and a handle;
    - the caller computes y [R, D] = expert_ids[i](x[i]) for every row (no weighting), in the activation dtype;
    - `combine(y, handle)` returns [T, D] in x's dtype: for each of this rank's tokens the sum over its k slots,
      in slot order, of topk_weights * its expert's output, accumulated in fp32;
    - a handle is used by exactly one `combine`, on the rank that made it.
    """

    def __init__(self, layout: ParallelLayout, num_experts: int):
        self.layout = layout
        self.experts_per_rank = num_experts // layout.expert_parallel

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[ExpertBatch, object]: ...

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle: object) -> torch.Tensor: ...


def weighted_sum_in_slot_order(
    slot_out: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """slot_out [T, k, D] (zero rows allowed), topk_weights [T, k] -> [T, D]: sum_j w[t, j] * slot_out[t, j]
    accumulated in fp32 slot by slot (an explicit loop: a reduction kernel may pick its order by shape)."""
    acc = torch.zeros(slot_out.shape[0], slot_out.shape[2], dtype=torch.float32,
                      device=slot_out.device)  # fmt: skip
    for j in range(slot_out.shape[1]):
        acc += topk_weights[:, j, None].float() * slot_out[:, j].float()
    return acc.to(out_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class _AllToAllHandle:
    order: torch.Tensor  # [T*k] the flat (token, slot) indices in the order they were sent
    send_counts: list[int]
    recv_counts: list[int]
    topk_weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


class AllToAllExchange(ExpertExchange):
    """For ranks holding different tokens. Dispatch: each (token, slot) row goes to the rank that owns its
    expert, grouped by destination, over `all_to_all_single` (counts, then rows, then local expert ids);
    combine: the outputs come back over the reverse `all_to_all_single` and are summed at home."""

    def dispatch(self, x, topk_ids, topk_weights):
        group, world = self.layout.group, self.layout.world_size
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).long()  # [T*k]
        dest = flat_ids // self.experts_per_rank  # [T*k] owning rank
        order = torch.argsort(dest, stable=True)  # rows grouped by destination, slot order within
        send_counts_t = torch.bincount(dest, minlength=world)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        num_recv = sum(recv_counts)
        send_x = x[order // k]  # [T*k, D]
        recv_x = x.new_empty(num_recv, x.shape[1])
        dist.all_to_all_single(recv_x, send_x, recv_counts, send_counts, group=group)
        send_ids = flat_ids[order] % self.experts_per_rank  # the owner's local ids
        recv_ids = flat_ids.new_empty(num_recv)
        dist.all_to_all_single(recv_ids, send_ids, recv_counts, send_counts, group=group)
        handle = _AllToAllHandle(order, send_counts, recv_counts, topk_weights, x.dtype)
        return ExpertBatch(recv_x, recv_ids), handle

    def combine(self, y, handle: _AllToAllHandle):  # type: ignore[override]
        num_slots = handle.order.shape[0]
        back = y.new_empty(num_slots, y.shape[1])
        dist.all_to_all_single(
            back, y.contiguous(), handle.send_counts, handle.recv_counts, group=self.layout.group
        )
        slot_out = torch.empty_like(back)
        slot_out[handle.order] = back  # [T*k, D] back in (token, slot) order
        weights = handle.topk_weights
        slot_out = slot_out.view(weights.shape[0], weights.shape[1], y.shape[1])  # [T, k, D]
        return weighted_sum_in_slot_order(slot_out, weights, handle.out_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class _AllReduceHandle:
    rows: torch.Tensor  # [R] flat (token, slot) indices computed here
    topk_weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


class AllReduceExchange(ExpertExchange):
    """For ranks holding the same tokens: no dispatch traffic (each rank takes the slots of its own experts);
    combine sums each rank's fp32 partial over the group with one all-reduce. A token's partial on each rank is
    its local slots in slot order, so the result is batch-invariant, though its rounding differs from
    `AllToAllExchange`'s single sum."""

    def dispatch(self, x, topk_ids, topk_weights):
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).long()  # [T*k]
        mine = flat_ids // self.experts_per_rank == self.layout.ep_rank
        rows = mine.nonzero().squeeze(1)  # [R]
        batch = ExpertBatch(x[rows // k], flat_ids[rows] % self.experts_per_rank)
        return batch, _AllReduceHandle(rows, topk_weights, x.dtype)

    def combine(self, y, handle: _AllReduceHandle):  # type: ignore[override]
        weights = handle.topk_weights
        slot_out = y.new_zeros(weights.numel(), y.shape[1])
        slot_out[handle.rows] = y
        slot_out = slot_out.view(weights.shape[0], weights.shape[1], y.shape[1])  # [T, k, D]
        partial = weighted_sum_in_slot_order(slot_out, weights, torch.float32)
        dist.all_reduce(partial, group=self.layout.group)
        return partial.to(handle.out_dtype)


def make_exchange(layout: ParallelLayout, num_experts: int) -> ExpertExchange | None:
    """The exchange a layout's MoE layers use; None when every rank holds all experts."""
    if layout.expert_parallel == 1:
        return None
    if layout.same_tokens_on_all_ranks:
        return AllReduceExchange(layout, num_experts)
    return AllToAllExchange(layout, num_experts)
