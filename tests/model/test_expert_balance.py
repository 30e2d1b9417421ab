"""Expert balancing: the spare-slot placement (pure), the routing tables, and DP2 + EP2 (and DP4 + EP4, one
rank idle) ranks over gloo whose rebalance copies hot experts into spare slots: the copies are the home
weights bit for bit, rows reach them, fp32 outputs stay those of one process, and batch-invariant outputs keep
their bits (every row to its home copy: the sum order that gives one GPU's bits,
`expert_exchange.reduce_tree`)."""

from __future__ import annotations

import random

import pytest
import torch
from _parallel_ranks import spawn_gloo

from pdserve.model.errors import ConfigError
from pdserve.model.expert_balance import (
    NO_EXPERT,
    ExpertRouting,
    SlotLayout,
    plan_spares,
    rank_loads,
)
from pdserve.model.loader import load_model
from pdserve.model.parallel import WorkerLayout


def zipf_load(num_experts: int, exponent: float, seed: int) -> list[float]:
    """Tokens per expert when the i-th hottest expert gets 1/i^exponent of them, the hot ones at random ids."""
    order = list(range(num_experts))
    random.Random(seed).shuffle(order)
    load = [0.0] * num_experts
    for rank, expert in enumerate(order, start=1):
        load[expert] = 1000.0 / rank**exponent
    return load


def imbalance(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


@pytest.mark.parametrize("ranks,spares", [(2, 1), (4, 2), (8, 4)])
def test_placement_spreads_a_zipf_routing(ranks, spares):
    slots = SlotLayout(256, ranks, spares)
    for seed in range(3):
        load = zipf_load(256, 1.0, seed)
        plan = plan_spares(load, slots)
        assert len(plan) == ranks and all(len(held) == spares for held in plan)
        for rank, held in enumerate(plan):
            placed = [e for e in held if e != NO_EXPERT]
            assert len(set(placed)) == len(placed), "two copies of one expert on one rank"
            assert all(slots.home_rank(e) != rank for e in placed), "a copy on its home rank"
        before = imbalance(rank_loads(load, slots, [[NO_EXPERT] * spares] * ranks))
        after = imbalance(rank_loads(load, slots, plan))
        assert after < before and after < 1.15, (seed, before, after)
        assert plan_spares(load, slots) == plan  # the same plan on every rank


def test_placement_of_an_even_load_copies_nothing():
    slots = SlotLayout(16, 4, 2)
    assert plan_spares([5.0] * 16, slots) == [[NO_EXPERT] * 2] * 4
    assert plan_spares([0.0] * 16, slots) == [[NO_EXPERT] * 2] * 4


def test_placement_keeps_copies_in_their_slots():
    slots = SlotLayout(16, 4, 2)
    load = zipf_load(16, 1.2, 0)
    first = plan_spares(load, slots)
    shifted = [held[::-1] for held in first]  # the same experts, in the other slot
    assert plan_spares(load, slots, shifted) == shifted
    with pytest.raises(ValueError, match="15 loads for 16 experts"):
        plan_spares(load[:15], slots)


def test_routing_splits_rows_over_copies_and_counts_real_rows():
    slots = SlotLayout(
        8, 2, 1
    )  # rank 0: experts 0-3 in slots 0-3, spare 4; rank 1: 4-7 in 5-8, spare 9
    routing = ExpertRouting(slots, "cpu")
    table = routing.table
    ids = torch.tensor([[0, 5]] * 6)  # [T=6, k=2]
    counted = torch.tensor([True] * 5 + [False])
    assert routing.route(ids, counted, home_only=False).tolist() == [[0, 6]] * 6
    routing.set_spares([[NO_EXPERT], [0]])  # rank 1's spare holds expert 0
    assert routing.table is table  # in place: captured graphs read the new table
    slots_of_0 = routing.route(ids, None, home_only=False)[:, 0].tolist()
    assert sorted(set(slots_of_0)) == [0, 9] and slots_of_0.count(9) == 3
    assert routing.route(ids, None, home_only=True)[:, 0].tolist() == [0] * 6
    load = routing.take_load()
    assert load[0].item() == 5 + 6 + 6 and load[5].item() == 17
    assert routing.load.sum().item() == 0


def test_layout_checks_redundant_experts():
    assert WorkerLayout(4, expert_parallel=4, redundant_experts=8).spare_slots == 2
    with pytest.raises(ConfigError, match="redundant_experts=6: must be >= 0 and a multiple"):
        WorkerLayout(4, expert_parallel=4, redundant_experts=6)
    with pytest.raises(ConfigError, match="needs expert_parallel > 1"):
        WorkerLayout(2, redundant_experts=2)
    with pytest.raises(ConfigError, match="rebalance_steps=0"):
        WorkerLayout(2, expert_parallel=2, redundant_experts=2, rebalance_steps=0)


PROMPT_LENS = (7, 23, 16)
NUM_PAGES = 24


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def prefill_hidden(model, prompts: list[list[int]]) -> torch.Tensor | None:
    """The final hidden states of every prompt token [T, D], the prompts prefilled in one batch (every row,
    not only the last of each prompt: the tiny model's one MoE layer is its last, so only a row's own output
    shows what its experts computed); a rank with no prompts joins the exchanges (None)."""
    from pdserve.model.batch import SeqChunk, build_forward_batch
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache

    if not prompts:
        model.forward_idle()
        return None

    layout = KVCacheLayout.for_model(model.args, 16, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, NUM_PAGES, "cpu")
    chunks = [
        SeqChunk(p, 0, list(range(i * 8, i * 8 + -(-len(p) // 16)))) for i, p in enumerate(prompts)
    ]
    return model(build_forward_batch(chunks, 16, "cpu", decode=False), cache)


def _balanced_rank(rank, world, ckpt, prompts):
    from pdserve import kernels
    from pdserve.model.parallel import ParallelLayout

    layout = ParallelLayout(
        WorkerLayout(world, "data", expert_parallel=world, redundant_experts=2 * world),
        rank=rank,
    )
    model = load_model(ckpt, dtype=torch.float32, progress=False, layout=layout)
    with kernels.use(batch_invariant=True):
        invariant_before = prefill_hidden(model, prompts)
    prefill_hidden(model, prompts)  # the loads the rebalance reads: both passes' rows
    model.balancer.rebalance()  # collective; every layer's moves at once
    reference = load_model(ckpt, dtype=torch.float32, progress=False)
    copies_exact, spares_used = True, 0
    for layer, ref_layer in zip(model.layers, reference.layers, strict=True):
        routing = getattr(layer.ffn, "routing", None)
        if routing is None:
            continue
        for spare, expert in enumerate(routing.spares[rank]):
            if expert == NO_EXPERT:
                continue
            spares_used += 1
            slot = layer.ffn.slots.home_per_rank + spare
            ref = ref_layer.ffn.experts
            for name in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):  # scales: fp8 only
                mine, theirs = getattr(layer.ffn.experts, name), getattr(ref, name)
                if theirs is not None:
                    copies_exact &= torch.equal(
                        mine[slot].view(torch.uint8), theirs[expert].view(torch.uint8)
                    )
    after = prefill_hidden(model, prompts)
    with kernels.use(batch_invariant=True):
        invariant_after = prefill_hidden(model, prompts)
    for layer in model.layers:  # with the copies' weights gone, the rows they served must change
        if getattr(layer.ffn, "routing", None) is not None:
            layer.ffn.experts.w13.data[layer.ffn.slots.home_per_rank :] = 0
    spares_zeroed = prefill_hidden(model, prompts)
    return {
        "after": after, "spares_zeroed": spares_zeroed, "copies_exact": copies_exact,
        "spares_used": spares_used, "moved": model.balancer.moved_slots,
        "invariant_before": invariant_before, "invariant_after": invariant_after,
    }  # fmt: skip


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "variant,ranks", [("tiny-fp32", 2), ("tiny-fp8", 2), ("tiny-fp32", 4)],
    ids=["dp2-ep2", "dp2-ep2-fp8", "dp4-ep4"],
)  # fmt: skip
def test_rebalanced_copies_serve_rows_with_the_same_outputs(variant, ranks, checkpoint, tmp_path):
    ckpt = checkpoint(variant)
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    prompts = _prompts(model.args.vocab_size)
    by_rank = [[prompts[0], prompts[2]], [prompts[1]]]
    if ranks == 4:  # one rank without prompts: it joins the exchanges and the moves
        by_rank = [[prompts[0]], [prompts[1]], [], [prompts[2]]]
    results = spawn_gloo(tmp_path, _balanced_rank, [(str(ckpt), mine) for mine in by_rank])
    assert sum(r["spares_used"] for r in results) > 0 and results[0]["moved"] > 0
    changed = False
    for result, mine in zip(results, by_rank, strict=True):
        assert result["copies_exact"]
        if not mine:
            continue
        want = prefill_hidden(model, mine)
        got = result["after"]
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
        changed |= not torch.equal(result["spares_zeroed"], got)
        assert torch.equal(result["invariant_after"], result["invariant_before"]), (
            "batch-invariant bits changed by the rebalance"
        )
    assert changed, "no row reached a spare slot"
