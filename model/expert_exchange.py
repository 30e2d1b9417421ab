"""Expert-parallel MoE: moving tokens to the ranks that hold their routed experts and the outputs back.

`ExpertExchange` is the one interface, implemented on plain torch.distributed collectives (gloo on CPU, NCCL
alike) by:
- `AllGatherExchange` (ranks with different tokens, small expert-parallel groups): every rank gathers every
  rank's tokens, padded to a capacity, computes its own experts over all of them, and an all-to-all of equal
  splits brings each rank its tokens' partial sums. With a capacity fixed in advance (`max_tokens_per_rank`) it
  needs no host sync and no count exchange, so a CUDA graph can capture it;
- `AllToAllExchange` (ranks with different tokens, any group): each token travels only to the ranks holding its
  experts; the row counts cross first and the host reads them (one sync per dispatch);
- `AllReduceExchange` (every rank the same tokens: tensor-parallel attention): no dispatch traffic, one fp32
  all-reduce in combine.
`make_exchange` picks one from the layout (`ParallelLayout.exchange`, `ParallelLayout.max_tokens_per_rank`),
or `symmetric_exchange.SymmetricMemoryExchange` (the all-gather exchange's rows by one-sided copies).

A token travels once to each rank (all-to-all: each rank holding at least one of its top-k experts), with all k
ids: those of other ranks' experts map to local ids out of range, which `kernels.fused_moe` skips. So the local
experts run as one `fused_moe` over the received rows, giving per row the weighted sum of its local experts, and
the home rank adds the ranks' partial sums (each in the activation dtype) in rank order, in fp32. Every sum has a
fixed order (the kernel's per token, then rank order), none depends on arrival order, on the other tokens of the
step or on the token's rank, so a token's output is batch-invariant whenever the kernels are (their
batch-invariant mode), and given the same expert outputs per row, `AllGatherExchange` and `AllToAllExchange`
give the same bits.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import torch
import torch.distributed as dist

from ..kernels.fp8_quant import ACT_QUANT_GROUP
from ..kernels.fused_moe.ref import tree_sum
from .errors import ConfigError
from .parallel import ParallelLayout

ALL_GATHER_MAX_EP = 8
"""`make_exchange`'s 'auto' picks the all-gather exchange up to this many expert-parallel ranks. With top-8 of
256 experts a token has an expert on a given one of N ranks with probability 1 - C(256 - 256/N, 8) / C(256, 8):
0.996 at N = 2, 0.90 at 4, 0.66 at 8, 0.40 at 16. So up to 8 ranks gathering every token moves at most 1.5x the
rows an all-to-all moves, and saves its count exchange, host sync and uneven splits; beyond, the bytes win."""

CombineMode = Literal["all_to_all", "reduce_scatter"]

REDUCE_GROUPS = 8
"""Groups of consecutive experts a token's routed outputs are summed over as a tree in batch-invariant mode
(`kernels.fused_moe`'s `tree`); expert-parallel sizes dividing it give one GPU's bits."""


def reduce_tree(num_experts: int, expert_parallel: int) -> tuple[int, int] | None:
    """The `tree` a rank of `expert_parallel` ranks passes `fused_moe` for its share of `num_experts` routed
    experts: its REDUCE_GROUPS / N groups of num_experts / REDUCE_GROUPS experts each. None where the split
    does not fall on whole groups (then the ranks' sums follow slot order: batch-invariant within the
    layout, not across layouts)."""
    if num_experts % REDUCE_GROUPS or REDUCE_GROUPS % expert_parallel:
        return None
    return REDUCE_GROUPS // expert_parallel, num_experts // REDUCE_GROUPS


# torch 2.13 renamed the single-tensor all-gather and reduce-scatter (the old names warn); older torch
# (the floor is 2.6) has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertBatch:
    """The rows this rank's experts compute in one MoE layer, in `kernels.fused_moe`'s arguments: row i is the
    weighted sum over j of topk_weights[i, j] * expert topk_ids[i, j](x[i]), where ids outside
    [0, experts per rank) belong to other ranks (or to no token: padding) and contribute nothing."""

    x: torch.Tensor | None  # [R, D] in the activation dtype; None when the rows came quantized
    topk_ids: torch.Tensor  # [R, k] int64, local expert ids (>= experts per rank: not here)
    topk_weights: torch.Tensor  # [R, k] fp32
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None
    """The rows quantized, (e4m3 [R, D], fp32 scales [R, D / 128]), as `kernels.fused_moe` takes them."""

    @property
    def num_rows(self) -> int:
        return self.topk_ids.shape[0]


class Pending:
    """A collective in flight: `wait()` (once) waits for it (on GPUs: makes the current stream wait) and
    returns its result."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
        return self._finish()

    @classmethod
    def done(cls, result) -> Pending:
        """A finished one, whose `wait()` returns `result`."""
        return cls(None, lambda: result)


class ExpertExchange(abc.ABC):
    """Dispatch and combine for one MoE layer over the ranks of an expert-parallel group.

    Contract, per MoE layer and step:
    - every rank of the group calls `dispatch` then `combine`, in the same layer order, also with zero tokens
      (T = 0): both are collective;
    - `dispatch(x, topk_ids, topk_weights)`: x [T, D] this rank's tokens, topk_ids [T, k] global expert ids,
      topk_weights [T, k] fp32, as the router gave them. Returns the `ExpertBatch` this rank's experts must
      compute (R rows, R = 0 allowed) and a handle;
    - the caller computes y [R, D] in the activation dtype, as `ExpertBatch` says (`fused_moe` over the local
      experts; a row with no local expert gives zeros);
    - `combine(y, handle)` returns [T, D] in x's dtype: for each of this rank's tokens, the sum over its k
      experts of weight * expert output, accumulated in fp32 in a fixed order;
    - a handle is used by exactly one `combine`, on the rank that made it, before the next `dispatch`.
    """

    host_sync = False
    """Whether a dispatch waits for the host even when told the pass's `step_tokens` (then it cannot run inside
    a CUDA graph)."""

    def __init__(self, layout: ParallelLayout, num_experts: int):
        self.layout = layout
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // layout.worker.expert_parallel
        self.step_tokens: int | None = None
        """Most tokens any rank holds in the pass under way, the same on every rank, when the caller knows it
        (a worker's step plan tells every rank every rank's rows): set by `Transformer.step_tokens`."""

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[ExpertBatch, object]:  # fmt: skip
        """x_q: x quantized for fp8 experts (every rank gives it, or none): the rows travel so."""

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle: object, tree: bool = False) -> torch.Tensor:
        """tree: y holds each row's fp32 subtree of `fused_moe`'s tree sum; the ranks' subtrees of a token are
        added as the tree's top levels (`tree_sum`, in rank order)."""

    overlaps = False
    """Whether `dispatch_async` and `combine_async` leave their collective in flight (else they finish it
    before they return)."""

    def dispatch_async(self, x, topk_ids, topk_weights, x_q=None) -> Pending:
        """`dispatch`, its collective left in flight where the exchange can (`overlaps`): the caller may run
        other work before `wait()` returns `dispatch`'s result. The same contract and order otherwise."""
        return Pending.done(self.dispatch(x, topk_ids, topk_weights, x_q))

    def combine_async(self, y: torch.Tensor, handle: object, tree: bool = False) -> Pending:
        """`combine`, its collective left in flight where the exchange can (`overlaps`)."""
        return Pending.done(self.combine(y, handle, tree))

    def _local_ids(self, topk_ids: torch.Tensor, rank: torch.Tensor | int) -> torch.Tensor:
        """Global ids [R, k] -> `rank`'s local ids ([R] or one rank), experts per rank where another rank's
        (or no rank's: ids >= num_experts)."""
        topk_ids = topk_ids.long()
        owner = topk_ids // self.experts_per_rank
        if isinstance(rank, torch.Tensor):
            rank = rank[:, None]
        local = topk_ids % self.experts_per_rank
        return torch.where(owner == rank, local, self.experts_per_rank)

    def _pack_rows(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, rows: int,
        x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One byte message of `rows` rows [ids int32 k | weights fp32 k | x | pad], or with `x_q`
        [ids | weights | scales fp32 D/128 | x e4m3 | pad], so ids, weights and x cross in one collective,
        written in place (no padded copies); rows past T are padding: id `num_experts` (no rank's), weight 0,
        x 0 (scale 1)."""
        num_tokens, k = topk_ids.shape
        layout = _RowLayout(k, x.shape[1], x.dtype, x_q is not None)
        packed = torch.empty(rows, layout.row_bytes, dtype=torch.uint8, device=x.device)
        ids, weights, x_rows, scales = layout.views(packed)
        ids[:num_tokens] = topk_ids
        weights[:num_tokens] = topk_weights
        ids[num_tokens:] = self.num_experts
        weights[num_tokens:] = 0.0
        if x_q is None:
            x_rows[:num_tokens] = x
            x_rows[num_tokens:] = 0.0
        else:
            x_rows[:num_tokens] = x_q[0]
            x_rows[num_tokens:] = 0.0
            scales[:num_tokens] = x_q[1]
            scales[num_tokens:] = 1.0
        packed[:, layout.used_bytes :] = 0  # the alignment bytes
        return packed  # [rows, row bytes]

    def _unpack_rows(
        self, packed: torch.Tensor, k: int, dim: int, dtype: torch.dtype, quantized: bool = False
    ) -> ExpertBatch:
        """`_pack_rows`'s message (any ranks' rows, concatenated) -> this rank's `ExpertBatch`."""
        ids, weights, x, scales = _RowLayout(k, dim, dtype, quantized).views(packed)
        local_ids = self._local_ids(ids, self.layout.ep_rank)
        if quantized:
            return ExpertBatch(
                None, local_ids, weights.contiguous(), (x.contiguous(), scales.contiguous())
            )
        return ExpertBatch(x.contiguous(), local_ids, weights.contiguous())

    def _quantized(self, x_q) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The quantized rows to send, where the layout sends them so."""
        return x_q if self.layout.dispatch_fp8 else None


@dataclasses.dataclass(frozen=True, slots=True)
class _RowLayout:
    """Where a packed row's parts lie: ids int32 [k] | weights fp32 [k] | (scales fp32 [D/128]) | x | pad."""

    k: int
    dim: int
    dtype: torch.dtype
    quantized: bool

    @property
    def num_scales(self) -> int:
        return -(-self.dim // ACT_QUANT_GROUP) if self.quantized else 0

    @property
    def x_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.quantized else self.dtype

    @property
    def used_bytes(self) -> int:
        x_bytes = self.dim * torch.empty(0, dtype=self.x_dtype).element_size()
        return 8 * self.k + 4 * self.num_scales + x_bytes

    @property
    def row_bytes(self) -> int:
        return self.used_bytes + -self.used_bytes % _ROW_ALIGN

    def views(self, packed: torch.Tensor):
        """ids [R, k] int32, weights [R, k] fp32, x [R, D] and scales [R, D/128] fp32 (None unquantized), as
        strided views of `packed`."""
        k, s = self.k, self.num_scales
        ids = packed[:, : 4 * k].view(torch.int32)
        weights = packed[:, 4 * k : 8 * k].view(torch.float32)
        start = 8 * k + 4 * s
        scales = packed[:, 8 * k : start].view(torch.float32) if self.quantized else None
        x = packed[:, start : self.used_bytes].view(self.x_dtype)
        return ids, weights, x, scales


_ROW_ALIGN = 16
"""Bytes a packed row is padded to, so its int32, fp32 and activation views are aligned."""


@dataclasses.dataclass(frozen=True, slots=True)
class _AllGatherHandle:
    num_tokens: int
    capacity: int
    out_dtype: torch.dtype


class AllGatherExchange(ExpertExchange):
    """For ranks holding different tokens in a small expert-parallel group. Dispatch: one all-gather of every
    rank's tokens with their ids and weights, padded to `capacity` rows per rank, so this rank's experts
    compute N x capacity rows (padding rows and tokens with no expert here cost them nothing). Combine: one
    all-to-all of equal splits in the activation dtype returns rank r's partial sums for this rank's tokens,
    which are added in rank order in fp32 (as `AllToAllExchange`: the same bits); or, with
    `combine_by='reduce_scatter'`, one fp32 reduce-scatter (twice the bytes for bf16, and the sum order is
    the collective's: with two ranks a + b either way, so still the same bits; with more, NCCL's ring adds
    in an order that depends on the destination rank, so a token's bits could depend on its rank).

    Padding, in order: the pass's `step_tokens` when the caller set it (a worker's runner does, from its
    plan), else `capacity` (tokens per rank, the same on every rank) when given; either way no count exchange
    and no host sync, every shape fixed, so a CUDA graph can capture dispatch and combine; a rank with more
    tokens raises `ConfigError`. Neither: each dispatch first all-gathers the ranks' token counts and pads to
    their maximum (one small collective and one host sync)."""

    def __init__(
        self, layout: ParallelLayout, num_experts: int, capacity: int | None = None,
        combine_by: CombineMode = "all_to_all",
    ):  # fmt: skip
        super().__init__(layout, num_experts)
        if capacity is not None and capacity < 1:
            raise ConfigError(f"expert exchange: capacity={capacity} tokens per rank must be >= 1")
        if combine_by not in ("all_to_all", "reduce_scatter"):
            raise ConfigError(
                f"expert exchange: combine_by={combine_by!r}, expected 'all_to_all' or 'reduce_scatter'"
            )
        self.capacity = capacity
        self.combine_by = combine_by

    def _step_capacity(self, num_tokens: int, device: torch.device) -> int:
        if self.step_tokens is not None:
            if num_tokens > self.step_tokens:
                raise ConfigError(
                    f"expert exchange: {num_tokens} tokens on rank {self.layout.rank}, more than the "
                    f"{self.step_tokens} the step said a rank holds at most"
                )
            return self.step_tokens
        if self.capacity is not None:
            if num_tokens > self.capacity:
                raise ConfigError(
                    f"expert exchange: {num_tokens} tokens on rank {self.layout.rank} exceed the "
                    f"all-gather capacity of {self.capacity} tokens per rank (max_tokens_per_rank); a "
                    "step must not hold more"
                )
            return self.capacity
        world = self.layout.worker.ranks
        counts = torch.empty(world, dtype=torch.int64, device=device)
        mine = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
        _all_gather(counts, mine, group=self.layout.group)
        return int(counts.max())  # host sync: the padding must be known to size the message

    overlaps = True

    def dispatch(self, x, topk_ids, topk_weights, x_q=None):
        return self._dispatch(x, topk_ids, topk_weights, x_q, False).wait()

    def dispatch_async(self, x, topk_ids, topk_weights, x_q=None) -> Pending:
        return self._dispatch(x, topk_ids, topk_weights, x_q, True)

    def _dispatch(self, x, topk_ids, topk_weights, x_q, async_op: bool) -> Pending:
        world = self.layout.worker.ranks
        num_tokens, k = topk_ids.shape
        x_q = self._quantized(x_q)
        capacity = self._step_capacity(num_tokens, x.device)
        packed = self._pack_rows(x, topk_ids, topk_weights, capacity, x_q)  # [C, row bytes]
        gathered = packed.new_empty(world * capacity, packed.shape[1])  # [N * C, row bytes]
        work = _all_gather(gathered, packed, group=self.layout.group, async_op=async_op)

        def finish():  # R = N * C rows, by rank
            batch = self._unpack_rows(gathered, k, x.shape[1], x.dtype, x_q is not None)
            return batch, _AllGatherHandle(num_tokens, capacity, x.dtype)

        return Pending(work, finish)

    def combine(self, y, handle: _AllGatherHandle, tree: bool = False):  # type: ignore[override]
        return self._combine(y, handle, tree, False).wait()

    def combine_async(self, y, handle: _AllGatherHandle, tree: bool = False) -> Pending:  # type: ignore[override]
        return self._combine(y, handle, tree, True)

    def _combine(self, y, handle: _AllGatherHandle, tree: bool, async_op: bool) -> Pending:
        world, group = self.layout.worker.ranks, self.layout.group
        capacity, dim = handle.capacity, y.shape[1]
        if self.combine_by == "reduce_scatter" and not tree:
            out = y.new_empty(capacity, dim, dtype=torch.float32)
            work = _reduce_scatter(out, y.float().contiguous(), group=group, async_op=async_op)
            return Pending(work, lambda: out[: handle.num_tokens].to(handle.out_dtype))
        # [N * C, D]: rank r's partials (fp32 subtrees in the tree's mode) of this rank's C rows at r * C
        back = torch.empty_like(y)
        work = dist.all_to_all_single(back, y.contiguous(), group=group, async_op=async_op)

        def finish():
            parts = back.view(world, capacity, dim)[:, : handle.num_tokens]  # [N, T, D]
            if tree:
                return tree_sum(parts, 0).to(handle.out_dtype)
            out = torch.zeros(handle.num_tokens, dim, dtype=torch.float32, device=y.device)
            for rank in range(world):  # rank order, as AllToAllExchange adds
                out += parts[rank].float()
            return out.to(handle.out_dtype)

        return Pending(work, finish)


@dataclasses.dataclass(frozen=True, slots=True)
class _AllToAllHandle:
    tokens: torch.Tensor  # [S] the token of each row sent, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    out_dtype: torch.dtype


class AllToAllExchange(ExpertExchange):
    """For ranks holding different tokens, over `all_to_all_single`: dispatch sends the row counts, reads
    them on the host (the one host sync: uneven splits must be known there), then sends each token once to
    every rank holding one of its experts, with its global ids and weights in the same message; combine
    sends the partial sums back and adds them at home in rank order."""

    host_sync = True

    def dispatch(self, x, topk_ids, topk_weights, x_q=None):
        group, world = self.layout.group, self.layout.worker.ranks
        x_q = self._quantized(x_q)
        num_tokens, k = topk_ids.shape
        owner = topk_ids.long() // self.experts_per_rank  # [T, k]
        goes = torch.zeros(world, num_tokens, dtype=torch.bool, device=x.device)
        goes.scatter_(0, owner.t(), True)  # [N, T]: the token has an expert on that rank
        send_counts_t = goes.sum(1)  # [N]
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
        counts = torch.cat([send_counts_t, recv_counts_t]).tolist()  # the host sync
        send_counts, recv_counts = counts[:world], counts[world:]
        num_sent = sum(send_counts)
        # [S] (destination, token) pairs by destination, token order within; the size is known, so no sync
        flat = torch.nonzero_static(goes.view(-1), size=num_sent).squeeze(1)
        tokens = flat % max(num_tokens, 1)
        sent_q = None if x_q is None else (x_q[0][tokens], x_q[1][tokens])
        packed = self._pack_rows(
            x[tokens], topk_ids[tokens], topk_weights[tokens], num_sent, sent_q
        )
        received = packed.new_empty(sum(recv_counts), packed.shape[1])
        dist.all_to_all_single(received, packed, recv_counts, send_counts, group=group)
        batch = self._unpack_rows(received, k, x.shape[1], x.dtype, x_q is not None)
        return batch, _AllToAllHandle(tokens, send_counts, recv_counts, num_tokens, x.dtype)

    def combine(self, y, handle: _AllToAllHandle, tree: bool = False):  # type: ignore[override]
        back = y.new_empty(handle.tokens.shape[0], y.shape[1])  # [S, D]
        dist.all_to_all_single(
            back, y.contiguous(), handle.send_counts, handle.recv_counts, group=self.layout.group
        )
        if tree:  # each rank's subtree of a token in its own slot (zero where it holds none of its experts)
            world = len(handle.send_counts)
            parts = torch.zeros(
                world, handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device
            )
            start = 0
            for rank, count in enumerate(handle.send_counts):
                rows = slice(start, start + count)
                parts[rank].index_copy_(0, handle.tokens[rows], back[rows])
                start += count
            return tree_sum(parts, 0).to(handle.out_dtype)
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

    def dispatch(self, x, topk_ids, topk_weights, x_q=None):
        ids = self._local_ids(topk_ids.long(), self.layout.ep_rank)
        return ExpertBatch(x, ids, topk_weights.float(), x_q), x.dtype

    def combine(self, y, handle: torch.dtype, tree: bool = False):  # type: ignore[override]
        # the group's sum order is the collective's: a tree only with two ranks (a + b either way)
        partial = y.float()
        dist.all_reduce(partial, group=self.layout.group)
        return partial.to(handle)


def make_exchange(layout: ParallelLayout, num_experts: int) -> ExpertExchange | None:
    """The exchange a layout's MoE layers use; None when every rank holds all experts.

    The same tokens on every rank (tensor-parallel attention): `AllReduceExchange`. Different tokens
    (data-parallel attention), by `layout.exchange`: 'all_gather' or 'all_to_all' as named; 'auto' the
    all-gather one up to `ALL_GATHER_MAX_EP` expert-parallel ranks, the all-to-all one beyond. The all-gather
    one pads to `layout.max_tokens_per_rank` when set (no host sync: CUDA-graph capturable), else to the
    step's largest rank."""
    if layout.worker.expert_parallel == 1:
        return None
    if layout.worker.same_tokens_on_all_ranks:
        return AllReduceExchange(layout, num_experts)
    kind = layout.exchange
    if kind == "auto":
        kind = "all_gather" if layout.worker.expert_parallel <= ALL_GATHER_MAX_EP else "all_to_all"
    if kind == "all_gather":
        return AllGatherExchange(layout, num_experts, layout.max_tokens_per_rank)
    if kind == "symmetric":
        from .symmetric_exchange import SymmetricMemoryExchange

        return SymmetricMemoryExchange(layout, num_experts, layout.max_tokens_per_rank)
    return AllToAllExchange(layout, num_experts)
