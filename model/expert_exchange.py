"""Expert-parallel MoE: moving tokens to the ranks that hold their routed experts and the outputs back.

`ExpertExchange` is the one interface; `AllToAllExchange` (ranks with different tokens: data-parallel attention)
and `AllReduceExchange` (every rank the same tokens: tensor-parallel attention) implement it on plain
torch.distributed collectives, so they run on gloo (CPU) and NCCL alike.

A token travels once to each rank that holds at least one of its top-k experts (not once per expert), with all
k ids: those of other ranks' experts are out of the local range, which `kernels.fused_moe` skips. So the local
experts run as one `fused_moe` over the received rows, giving per row the weighted sum of its local experts, and
the home rank adds the ranks' partial sums in rank order, in fp32. Every sum has a fixed order (the kernel's per
token, then rank order), none depends on arrival order or on the other tokens of the step, so a token's output
is batch-invariant whenever the kernels are (their batch-invariant mode).
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.distributed as dist

from .parallel import ParallelLayout


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertBatch:
    """The rows this rank's experts compute in one MoE layer, in `kernels.fused_moe`'s arguments: row i is the
    weighted sum over j of topk_weights[i, j] * expert topk_ids[i, j](x[i]), where ids outside
    [0, experts per rank) belong to other ranks and contribute nothing."""

    x: torch.Tensor  # [R, D] in the activation dtype
    topk_ids: torch.Tensor  # [R, k] int64, local expert ids (>= experts per rank: not here)
    topk_weights: torch.Tensor  # [R, k] fp32

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]


class ExpertExchange(abc.ABC):
    """Dispatch and combine for one MoE layer over the ranks of an expert-parallel group.

    Contract, per MoE layer and step:
    - every rank of the group calls `dispatch` then `combine`, in the same layer order, also with zero tokens
      (T = 0): both are collective;
    - `dispatch(x, topk_ids, topk_weights)`: x [T, D] this rank's tokens, topk_ids [T, k] global expert ids,
      topk_weights [T, k] fp32, as the router gave them. Returns the `ExpertBatch` this rank's experts must
      compute (R rows, R = 0 allowed) and a handle;
    - the caller computes y [R, D] in the activation dtype, as `ExpertBatch` says (`fused_moe` over the local
      experts);
    - `combine(y, handle)` returns [T, D] in x's dtype: for each of this rank's tokens, the sum over its k
      experts of weight * expert output, accumulated in fp32 in a fixed order;
    - a handle is used by exactly one `combine`, on the rank that made it, before the next `dispatch`.
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

    def _local_ids(self, topk_ids: torch.Tensor, rank: torch.Tensor | int) -> torch.Tensor:
        """Global ids [R, k] -> `rank`'s local ids ([R] or one rank), experts per rank where another rank's."""
        owner = topk_ids // self.experts_per_rank
        if isinstance(rank, torch.Tensor):
            rank = rank[:, None]
        local = topk_ids % self.experts_per_rank
        return torch.where(owner == rank, local, self.experts_per_rank)


@dataclasses.dataclass(frozen=True, slots=True)
class _AllToAllHandle:
    tokens: torch.Tensor  # [S] the token of each row sent, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    out_dtype: torch.dtype


class AllToAllExchange(ExpertExchange):
    """For ranks holding different tokens, over `all_to_all_single`: dispatch sends the row counts, then each
    token's x once to every rank holding one of its experts, then its ids and weights (one fp32 message: ids
    are exact in fp32 below 2^24); combine sends the partial sums back and adds them at home in rank order."""

    def dispatch(self, x, topk_ids, topk_weights):
        group, world = self.layout.group, self.layout.world_size
        num_tokens, k = topk_ids.shape
        owner = topk_ids.long() // self.experts_per_rank  # [T, k]
        goes = torch.zeros(world, num_tokens, dtype=torch.bool, device=x.device)
        goes.scatter_(0, owner.t(), True)  # [N, T]: the token has an expert on that rank
        dest, tokens = goes.nonzero(as_tuple=True)  # [S] each, by destination, token order within
        send_counts_t = goes.sum(1)  # [N]
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        num_recv = sum(recv_counts)
        recv_x = x.new_empty(num_recv, x.shape[1])
        dist.all_to_all_single(recv_x, x[tokens], recv_counts, send_counts, group=group)
        ids = self._local_ids(topk_ids[tokens].long(), dest)  # [S, k] the destination's ids
        meta = torch.cat([ids.float(), topk_weights[tokens].float()], dim=1)  # [S, 2k]
        recv_meta = meta.new_empty(num_recv, 2 * k)
        dist.all_to_all_single(recv_meta, meta, recv_counts, send_counts, group=group)
        batch = ExpertBatch(recv_x, recv_meta[:, :k].long(), recv_meta[:, k:].contiguous())
        return batch, _AllToAllHandle(tokens, send_counts, recv_counts, num_tokens, x.dtype)

    def combine(self, y, handle: _AllToAllHandle):  # type: ignore[override]
        back = y.new_empty(handle.tokens.shape[0], y.shape[1])  # [S, D]
        dist.all_to_all_single(
            back, y.contiguous(), handle.send_counts, handle.recv_counts, group=self.layout.group
        )
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        start = 0
        for count in handle.send_counts:  # rank order; a token appears at most once per rank
            rows = slice(start, start + count)
            out.index_add_(0, handle.tokens[rows], back[rows].float())
            start += count
        return out.to(handle.out_dtype)


class AllReduceExchange(ExpertExchange):
    """For ranks holding the same tokens: no dispatch traffic (every rank computes all tokens over its own
    experts); combine sums the partials over the group with one fp32 all-reduce."""

    def dispatch(self, x, topk_ids, topk_weights):
        ids = self._local_ids(topk_ids.long(), self.layout.ep_rank)
        return ExpertBatch(x, ids, topk_weights.float()), x.dtype

    def combine(self, y, handle: torch.dtype):  # type: ignore[override]
        partial = y.float()
        dist.all_reduce(partial, group=self.layout.group)
        return partial.to(handle)


def make_exchange(layout: ParallelLayout, num_experts: int) -> ExpertExchange | None:
    """The exchange a layout's MoE layers use; None when every rank holds all experts."""
    if layout.expert_parallel == 1:
        return None
    if layout.same_tokens_on_all_ranks:
        return AllReduceExchange(layout, num_experts)
    return AllToAllExchange(layout, num_experts)
