"""A one-sided expert exchange over torch symmetric memory (CUDA over NVLink; no NVSHMEM, no NVLink multicast):
`SymmetricMemoryExchange`, the all-gather exchange's contract and bits without NCCL.

Dispatch: each rank packs its rows (padded to the step's capacity, as `AllGatherExchange` does) and writes them
into slot [its rank] of every rank's receive buffer; a device-side barrier later, each rank reads every rank's
rows from its own buffer. Combine: each rank writes its partial sums of rank r's tokens into slot [its rank] of
rank r's combine buffer; a barrier later, each rank adds its slots in rank order (the all-gather exchange's
order and bits). The copies are plain device copies through the peers' mapped memory, the barriers kernels on
the buffers' signal pads, so no host sync and no NCCL kernel: CUDA graphs capture it.

Buffers are symmetric allocations (every rank the same size, joined by a collective rendezvous), one pair per
capacity class (powers of two) shared by all the MoE layers of a model (`SymmetricBuffers`: layers run one
after another, and a buffer is written again only after the barrier that ends its last read), and kept for the
model's life: a captured graph holds their addresses. A class is allocated at the first step that needs it
(every rank at once, the step's capacity being the same on every rank); the CUDA-graph warm-up runs a bucket
eagerly before capturing it, so no allocation happens inside a capture.
"""

from __future__ import annotations

import torch

from ..kernels.fused_moe.ref import tree_sum
from .errors import ConfigError
from .expert_exchange import AllGatherExchange, Pending, _AllGatherHandle
from .parallel import ParallelLayout

__all__ = ["SymmetricBuffers", "SymmetricMemoryExchange"]

_DISPATCH, _COMBINE = "dispatch", "combine"


class SymmetricBuffers:
    """A model's symmetric buffers for its exchanges, by (purpose, capacity class, row bytes)."""

    def __init__(self, layout: ParallelLayout):
        self.layout = layout
        self._buffers: dict[tuple[str, int, int], tuple[torch.Tensor, object]] = {}

    def get(
        self, purpose: str, capacity: int, row_bytes: int, device: torch.device
    ) -> tuple[torch.Tensor, object, int]:
        """(this rank's buffer [N * class * row_bytes] uint8, its symmetric-memory handle, the class) for
        `capacity` rows a rank of `row_bytes` each; allocated now if new (collective: every rank of the group
        calls it with the same arguments)."""
        from torch.distributed import _symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ConfigError(f"exchange='symmetric': needs CUDA GPUs (the tokens are on {device})")
        rows = 1 << max(0, capacity - 1).bit_length()  # the capacity class: a power of two
        key = (purpose, rows, row_bytes)
        found = self._buffers.get(key)
        if found is None:
            world = self.layout.worker.ranks
            buffer = symm_mem.empty(world * rows * row_bytes, dtype=torch.uint8, device=device)
            group = self.layout.group
            if group is None:
                import torch.distributed as dist

                group = dist.group.WORLD
            found = (buffer, symm_mem.rendezvous(buffer, group))
            self._buffers[key] = found
        return found[0], found[1], rows


class SymmetricMemoryExchange(AllGatherExchange):
    """`AllGatherExchange`'s contract (padding to the step's tokens or `capacity`, the same `ExpertBatch`,
    the same sums) moved by one-sided copies into the peers' symmetric buffers (see the module docstring).
    CUDA only. `buffers`: the model's shared `SymmetricBuffers` (`Transformer` hands every exchange the same
    one; None: its own)."""

    overlaps = False

    def __init__(
        self, layout: ParallelLayout, num_experts: int, capacity: int | None = None,
        buffers: SymmetricBuffers | None = None,
    ):  # fmt: skip
        super().__init__(layout, num_experts, capacity)
        self.buffers = buffers or SymmetricBuffers(layout)

    def _dispatch(self, x, topk_ids, topk_weights, x_q, async_op: bool) -> Pending:
        world, me = self.layout.worker.ranks, self.layout.rank
        num_tokens, k = topk_ids.shape
        x_q = self._quantized(x_q)
        capacity = self._step_capacity(num_tokens, x.device)
        packed = self._pack_rows(x, topk_ids, topk_weights, capacity, x_q)  # [C, B]
        row_bytes = packed.shape[1]
        buffer, handle, rows = self.buffers.get(_DISPATCH, capacity, row_bytes, x.device)
        handle.barrier(channel=0)  # every rank is done reading the buffers' last contents
        for peer in range(world):
            slots = handle.get_buffer(peer, (world, rows, row_bytes), torch.uint8)
            slots[me, :capacity].copy_(packed)
        handle.barrier(channel=1)  # every rank's rows have landed here
        gathered = buffer.view(world, rows, row_bytes)[:, :capacity].reshape(-1, row_bytes)
        batch = self._unpack_rows(gathered, k, x.shape[1], x.dtype, x_q is not None)  # copies out
        return Pending.done((batch, _AllGatherHandle(num_tokens, capacity, x.dtype)))

    def _combine(self, y, handle_, tree: bool, async_op: bool) -> Pending:
        world, me = self.layout.worker.ranks, self.layout.rank
        capacity, dim = handle_.capacity, y.shape[1]
        row_bytes = dim * y.element_size()
        buffer, handle, rows = self.buffers.get(_COMBINE, capacity, row_bytes, y.device)
        handle.barrier(channel=0)
        y = y.contiguous().view(world, capacity, dim)  # [N, C, D]: rank r's tokens' partials at r
        for peer in range(world):
            slots = handle.get_buffer(peer, (world, rows, dim), y.dtype)
            slots[me, :capacity].copy_(y[peer])
        handle.barrier(channel=1)
        parts = buffer.view(y.dtype).view(world, rows, dim)[:, : handle_.num_tokens]  # [N, T, D]
        if tree:
            return Pending.done(tree_sum(parts, 0).to(handle_.out_dtype))
        out = torch.zeros(handle_.num_tokens, dim, dtype=torch.float32, device=y.device)
        for rank in range(world):  # rank order, as the other exchanges add
            out += parts[rank].float()
        return Pending.done(out.to(handle_.out_dtype))
