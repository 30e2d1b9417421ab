"""Expert balancing: spare routed-expert slots that hold copies of the hottest experts, placed by the loads each
rank counts, so that a skewed routing spreads over an expert-parallel group.

Slots. With E routed experts over N ranks and S spare slots a rank (`WorkerLayout.spare_slots`), rank r holds
P = E/N + S slots per MoE layer: slots [0, E/N) its home experts r*E/N + i (never moved), slots [E/N, P)
copies of other ranks' experts (or nothing). A slot's global id is r*P + its local id, which is what the
expert exchange carries (it is built over N*P experts), so the exchange and `kernels.fused_moe` are unchanged.

Routing (`ExpertRouting.route`, one per balanced MoE layer): the gate's expert ids go to one of the expert's
copies, chosen by the (row + slot) index modulo its number of copies, so its rows split evenly among them. All
tensor ops over fixed-size tables: no host sync, CUDA graphs capture it, and the tables are updated in place.
Batch-invariant mode routes every row to the home copy: its sums follow the home ranks' tree
(`expert_exchange.reduce_tree`), which a copy elsewhere would break, so rebalancing never changes its bits.

Counting: each layer adds its rows' expert ids to an int64 counter [E] inside the forward (the decode graphs'
padding rows, which cache fewer than two tokens, are not counted).

Placement (`plan_spares`, pure and deterministic, so every rank computes the same one from the same counts):
the expert with the largest load per copy gets a copy on the least loaded rank with a free slot that does
not hold it yet, as long as that lowers the busiest rank's load; experts that stay on a rank keep their slot.

Rebalancing (`ExpertBalancer`, collective over the worker's group, called by every rank after every step):
every `rebalance_steps` steps the ranks sum their counts (one all-reduce), compute the placement and reset the
counts; then after each later step `layers_per_step` layers move: each new copy travels from its home rank in
one batched point-to-point exchange, and the layer's routing table changes after its weights arrived. A move
happens between steps, so no step sees a slot half written; the other layers keep routing by their old tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .parallel import ParallelLayout

__all__ = ["ExpertBalancer", "ExpertRouting", "SlotLayout", "plan_spares", "rank_loads"]

NO_EXPERT = -1
"""A spare slot holding no copy."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotLayout:
    """How one MoE layer's experts map to slots over an expert-parallel group (see the module docstring)."""

    num_experts: int
    ranks: int
    spares: int
    """Spare slots per rank."""

    @property
    def home_per_rank(self) -> int:
        return self.num_experts // self.ranks

    @property
    def slots_per_rank(self) -> int:
        return self.home_per_rank + self.spares

    @property
    def num_slots(self) -> int:
        """Slots over the group: the number of experts the expert exchange is built over."""
        return self.ranks * self.slots_per_rank

    def home_rank(self, expert: int) -> int:
        return expert // self.home_per_rank

    def home_slot(self, expert: int) -> int:
        """Global slot id of an expert's home copy."""
        return self.home_rank(expert) * self.slots_per_rank + expert % self.home_per_rank

    def spare_slot(self, rank: int, spare: int) -> int:
        """Global slot id of rank `rank`'s spare slot `spare`."""
        return rank * self.slots_per_rank + self.home_per_rank + spare


def rank_loads(
    load: Sequence[float], slots: SlotLayout, spares: Sequence[Sequence[int]]
) -> list[float]:
    """Each rank's share of `load` (tokens per expert) when an expert's tokens split evenly over its copies:
    its home copy and the spare slots `spares[r][s]` holding it."""
    copies = [[slots.home_rank(e)] for e in range(slots.num_experts)]
    for rank, held in enumerate(spares):
        for expert in held:
            if expert != NO_EXPERT:
                copies[expert].append(rank)
    out = [0.0] * slots.ranks
    for expert, holders in enumerate(copies):
        for rank in holders:
            out[rank] += load[expert] / len(holders)
    return out


def plan_spares(
    load: Sequence[float], slots: SlotLayout, current: Sequence[Sequence[int]] | None = None
) -> list[list[int]]:
    """The expert each rank's spare slots should hold (`NO_EXPERT`: none), for `load` (tokens per expert).

    Greedy: while a spare slot is free, the busiest rank's expert with the largest load per copy gets a copy
    on the least loaded rank with a free slot that does not hold it, if that rank's new load stays below the
    busiest rank's (else the busiest rank's next expert; none: done). Ties go to the lower id, so every rank
    computes the same plan. `current` (the spare slots' present experts): an expert placed on a rank keeps
    the slot it is in, so only changed slots move."""
    if len(load) != slots.num_experts:
        raise ValueError(f"plan_spares: {len(load)} loads for {slots.num_experts} experts")
    load = [float(v) for v in load]
    copies = [[slots.home_rank(e)] for e in range(slots.num_experts)]
    rank_load = [0.0] * slots.ranks
    for expert, value in enumerate(load):
        rank_load[slots.home_rank(expert)] += value
    free = [slots.spares] * slots.ranks
    placed: list[list[int]] = [[] for _ in range(slots.ranks)]
    while any(free):
        busiest = min(range(slots.ranks), key=lambda r: (-rank_load[r], r))
        held = [e for e in range(slots.num_experts) if busiest in copies[e] and load[e] > 0]
        chosen = None
        for expert in sorted(held, key=lambda e: (-load[e] / len(copies[e]), e)):
            targets = [r for r in range(slots.ranks) if free[r] and r not in copies[expert]]
            if not targets:
                continue
            rank = min(targets, key=lambda r: (rank_load[r], r))
            share = load[expert] / (len(copies[expert]) + 1)
            if rank_load[rank] + share < rank_load[busiest]:
                chosen = expert, rank, share
                break
        if chosen is None:
            break
        expert, rank, share = chosen
        old_share = load[expert] / len(copies[expert])
        for holder in copies[expert]:
            rank_load[holder] -= old_share - share
        rank_load[rank] += share
        copies[expert].append(rank)
        placed[rank].append(expert)
        free[rank] -= 1
    return [_keep_slots(placed[r], slots.spares, None if current is None else current[r])
            for r in range(slots.ranks)]  # fmt: skip


def _keep_slots(experts: list[int], spares: int, current: Sequence[int] | None) -> list[int]:
    """`experts` laid into `spares` slots, each already in a slot (`current`) staying there."""
    out = [NO_EXPERT] * spares
    rest = list(experts)
    if current is not None:
        for slot, expert in enumerate(current):
            if expert != NO_EXPERT and expert in rest:
                out[slot] = expert
                rest.remove(expert)
    for slot in range(spares):
        if out[slot] == NO_EXPERT and rest:
            out[slot] = rest.pop(0)
    return out


class ExpertRouting:
    """One balanced MoE layer's routing tables and load counter, on the layer's device.

    `copies[e]`: how many copies expert e has (1 + spare slots holding it); `table[e, :copies[e]]` their global
    slot ids, the home copy first; `load[e]`: rows routed to e since the last `take_load`."""

    def __init__(self, slots: SlotLayout, device: torch.device | str):
        self.slots = slots
        e = slots.num_experts
        self.spares: list[list[int]] = [[NO_EXPERT] * slots.spares for _ in range(slots.ranks)]
        self.table = torch.zeros(e, slots.ranks, dtype=torch.int64, device=device)  # [E, N]
        self.copies = torch.ones(e, dtype=torch.int64, device=device)  # [E]
        self.home = torch.tensor([slots.home_slot(x) for x in range(e)], device=device)  # [E]
        self.load = torch.zeros(e, dtype=torch.int64, device=device)  # [E]
        self.set_spares(self.spares)

    def set_spares(self, spares: list[list[int]]) -> None:
        """Routes by `spares` (each rank's spare slots' experts) from the next forward on (in place, so
        captured graphs read the new tables)."""
        e, n = self.slots.num_experts, self.slots.ranks
        table = [[self.slots.home_slot(x)] for x in range(e)]
        for rank, held in enumerate(spares):
            for spare, expert in enumerate(held):
                if expert != NO_EXPERT:
                    table[expert].append(self.slots.spare_slot(rank, spare))
        copies = torch.tensor([len(t) for t in table], dtype=torch.int64)
        padded = torch.tensor([t + [t[0]] * (n - len(t)) for t in table], dtype=torch.int64)
        self.table.copy_(padded)
        self.copies.copy_(copies)
        self.spares = [list(held) for held in spares]

    def route(
        self, ids: torch.Tensor, counted: torch.Tensor | None, home_only: bool
    ) -> torch.Tensor:
        """ids [T, k] expert ids -> global slot ids [T, k]; counts the rows (`counted` [T] bool: the rows to
        count, None: all). `home_only`: every row to its expert's home copy (batch-invariant mode)."""
        ids = ids.long()
        ones = torch.ones_like(ids) if counted is None else counted[:, None].expand_as(ids).long()
        self.load.index_add_(0, ids.reshape(-1), ones.reshape(-1))
        if home_only:
            return self.home[ids]
        t, k = ids.shape
        turn = torch.arange(t, device=ids.device)[:, None] + torch.arange(k, device=ids.device)
        return self.table[ids, turn % self.copies[ids]]  # [T, k]

    def take_load(self) -> torch.Tensor:
        """The counts since the last call ([E] int64, a copy), and zero counts from now."""
        out = self.load.clone()
        self.load.zero_()
        return out


@dataclasses.dataclass
class _Move:
    """A layer's new spare placement, waiting for its weights to move."""

    layer: int
    spares: list[list[int]]


class ExpertBalancer:
    """Rebalances a model's balanced MoE layers over its expert-parallel group (see the module docstring).

    `layers`: (routing, the layer's `Experts` module) per balanced MoE layer, in layer order, the same on every
    rank. `after_step()` is collective: every rank of the group calls it after every step, the same number of
    times."""

    def __init__(
        self, layers: list[tuple[ExpertRouting, torch.nn.Module]], layout: ParallelLayout,
        rebalance_steps: int, layers_per_step: int = 8,
    ):  # fmt: skip
        if rebalance_steps < 1 or layers_per_step < 1:
            raise ValueError(
                f"rebalance_steps={rebalance_steps}, layers_per_step={layers_per_step}: must be >= 1"
            )
        self.layers, self.layout = layers, layout
        self.rebalance_steps, self.layers_per_step = rebalance_steps, layers_per_step
        self.steps = 0
        self.pending: list[_Move] = []
        self.rebalances = 0
        """Placements computed so far."""
        self.moved_slots = 0
        """Spare slots whose expert changed so far (on any rank)."""
        self.balancedness: float | None = None
        """How evenly the ranks shared the rows of the window before the last placement, under the copies in
        place then: the mean rank's rows over the busiest rank's (1.0: even), averaged over the layers that
        routed any (vLLM's EPLB 'balancedness'); None before the first placement."""

    def after_step(self) -> None:
        """Counts a step; moves the next layers of a pending placement, or computes a new one when
        `rebalance_steps` steps have passed since the last."""
        self.steps += 1
        if self.pending:
            self._move(self.pending[: self.layers_per_step])
            del self.pending[: self.layers_per_step]
        elif self.steps >= self.rebalance_steps:
            self.rebalance(moves_now=False)

    def rebalance(self, moves_now: bool = True) -> None:
        """Sums the ranks' counts, plans every layer's spares and resets the counts (collective). The moves
        follow in `after_step`, or all at once here with `moves_now`."""
        self.steps = 0
        loads = torch.stack([routing.take_load() for routing, _ in self.layers])  # [L, E]
        dist.all_reduce(loads, group=self.layout.group)
        self.rebalances += 1
        self.pending = []
        ratios = []
        for layer, ((routing, _), load) in enumerate(zip(self.layers, loads.tolist(), strict=True)):
            per_rank = rank_loads(load, routing.slots, routing.spares)
            if max(per_rank) > 0:
                ratios.append(sum(per_rank) / len(per_rank) / max(per_rank))
            spares = plan_spares(load, routing.slots, routing.spares)
            if spares != routing.spares:
                self.pending.append(_Move(layer, spares))
        if ratios:
            self.balancedness = sum(ratios) / len(ratios)
        if moves_now:
            self._move(self.pending)
            self.pending = []

    def _move(self, moves: list[_Move]) -> None:
        """Sends each changed spare slot its expert's weights from the expert's home rank, in one batched
        exchange, then switches those layers' routing."""
        me, group = self.layout.ep_rank, self.layout.group
        ops: list[dist.P2POp] = []
        for move in moves:
            routing, experts = self.layers[move.layer]
            slots = routing.slots
            for rank, (old, new) in enumerate(zip(routing.spares, move.spares, strict=True)):
                for spare, (before, expert) in enumerate(zip(old, new, strict=True)):
                    if expert in (before, NO_EXPERT):
                        continue
                    self.moved_slots += 1
                    home = slots.home_rank(expert)
                    src = expert % slots.home_per_rank
                    dst = slots.home_per_rank + spare
                    assert home != rank, "a rank never holds a copy of its own expert"
                    for weight in _slot_tensors(experts):  # as bytes: gloo has no fp8
                        if home == me:
                            send = weight[src].view(torch.uint8)
                            ops.append(dist.P2POp(dist.isend, send, self._peer(rank), group))
                        elif rank == me:
                            recv = weight[dst].view(torch.uint8)
                            ops.append(dist.P2POp(dist.irecv, recv, self._peer(home), group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for move in moves:
            self.layers[move.layer][0].set_spares(move.spares)

    def _peer(self, rank: int) -> int:
        """The global rank of rank `rank` of the layout's group (point-to-point ops name global ranks)."""
        group = self.layout.group
        return rank if group is None else dist.get_global_rank(group, rank)


def _slot_tensors(experts: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors an expert slot is made of, each indexed by slot along dim 0."""
    out = [experts.w13, experts.w2]
    if experts.w13_scale_inv is not None:
        out += [experts.w13_scale_inv, experts.w2_scale_inv]
    return [t.data for t in out]
