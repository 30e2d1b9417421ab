"""The expert exchanges over gloo, two processes, with row-wise stand-in experts (each output row depends only on
its input row, ids and weights, so any difference comes from the exchange): every token gets the ranks' partial
sums of its k weighted expert outputs, added in rank order; a token's output is bit-for-bit the same whichever
tokens share its step and whichever rank it sits on; a token travels once per rank holding its experts; ranks
with no tokens (one or all) take part."""

from __future__ import annotations

import pytest
import torch
from _parallel_ranks import spawn_gloo

from pdserve.model.expert_exchange import AllReduceExchange, AllToAllExchange
from pdserve.model.parallel import ParallelLayout

NUM_EXPERTS, TOP_K, DIM = 8, 3, 16


def expert(global_id: int, x: torch.Tensor) -> torch.Tensor:
    """A row-wise stand-in for expert `global_id`."""
    return torch.sin(x * (global_id + 1) * 0.37) + 0.1 * global_id


def make_tokens(seed: int, num_tokens: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, DIM, generator=g).to(dtype)
    ids = [torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)]
    ids = torch.stack(ids) if ids else torch.empty(0, TOP_K, dtype=torch.int64)
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    return x, ids, weights


def local_experts(x, ids, weights, first: int, per_rank: int) -> torch.Tensor:
    """A row-wise stand-in for `fused_moe` over the experts [first, first + per_rank), ids local: per row
    the weighted sum of its local experts in slot order (fp32), in x's dtype."""
    acc = torch.zeros(x.shape[0], DIM)
    for j in range(ids.shape[1]):
        for row in range(x.shape[0]):
            if 0 <= int(ids[row, j]) < per_rank:
                acc[row] += weights[row, j] * expert(first + int(ids[row, j]), x[row]).float()
    return acc.to(x.dtype)


def expected(x, ids, weights, world: int = 2) -> torch.Tensor:
    """Each rank's partial (its experts, slot order) in x's dtype, summed in rank order in fp32."""
    per_rank = NUM_EXPERTS // world
    acc = torch.zeros(x.shape[0], DIM)
    for rank in range(world):
        first = rank * per_rank
        local = torch.where(ids // per_rank == rank, ids % per_rank, per_rank)
        acc += local_experts(x, local, weights, first, per_rank).float()
    return acc.to(x.dtype)


def _exchange_rank(rank, world, runs):
    """runs: (kind, steps) pairs, steps[rank] this rank's (x, ids, weights) per step; per run and step, the
    combined output and the rows this rank's experts computed."""
    outputs = []
    for kind, steps in runs:
        layout = ParallelLayout(
            world_size=world, rank=rank, attention="tensor" if kind == "all_reduce" else "data",
            expert_parallel=world,
        )  # fmt: skip
        cls = AllReduceExchange if kind == "all_reduce" else AllToAllExchange
        exchange = cls(layout, NUM_EXPERTS)
        first = rank * exchange.experts_per_rank
        outputs.append([])
        for x, ids, weights in steps[rank]:
            local, handle = exchange.dispatch(x, ids, weights)
            per_rank = exchange.experts_per_rank
            # every row received has at least one expert here (all_to_all sends only there)
            here = (local.topk_ids < per_rank).any(1)
            assert kind == "all_reduce" or bool(here.all())
            y = local_experts(local.x, local.topk_ids, local.topk_weights, first, per_rank)
            outputs[-1].append((exchange.combine(y, handle), local.num_rows))
    return outputs


def cat(*parts):
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def all_to_all_steps(dtype):
    """Step 0: token X first on rank 0 among five others; step 1: X alone on rank 1; step 2: rank 1 has no
    tokens; step 3: neither has."""
    x_tok = make_tokens(1, 1, dtype)
    a, b = make_tokens(2, 5, dtype), make_tokens(3, 2, dtype)
    empty = make_tokens(4, 0, dtype)
    return [[cat(x_tok, a), b, a, empty], [b, x_tok, empty, empty]]


def all_reduce_steps():
    """Every rank the same tokens: X first among six, X last, none."""
    x_tok, a = make_tokens(1, 1, torch.float32), make_tokens(2, 6, torch.float32)
    same = [cat(x_tok, a), cat(a, x_tok), make_tokens(4, 0, torch.float32)]
    return [same, same]


DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [("all_to_all", all_to_all_steps(d)) for d in DTYPES]
    runs.append(("all_reduce", all_reduce_steps()))
    return spawn_gloo(tmp_path_factory.mktemp("exchange"), _exchange_rank, [(runs,)] * 2)


def owner_ranks(ids: torch.Tensor) -> int:
    """Sum over tokens of the ranks holding at least one of its experts."""
    per_rank = NUM_EXPERTS // 2
    return sum(len(set((row // per_rank).tolist())) for row in ids)


@pytest.mark.parametrize("run", range(len(DTYPES)))
def test_all_to_all_exchange(results, run):
    steps = all_to_all_steps(DTYPES[run])
    for rank in range(2):
        for step, (out, _) in zip(steps[rank], results[rank][run], strict=True):
            assert out.shape == step[0].shape and out.dtype == DTYPES[run]
            assert torch.equal(out, expected(*step))
    # X alone on rank 1 equals X among five companions on rank 0, bit for bit
    assert torch.equal(results[1][run][1][0][0], results[0][run][0][0][0])
    # a token travels once to each rank holding one of its experts, not once per expert
    for s in range(len(steps[0])):
        rows = sum(results[rank][run][s][1] for rank in range(2))
        assert rows == sum(owner_ranks(steps[rank][s][1]) for rank in range(2))


def test_all_reduce_exchange(results):
    steps = all_reduce_steps()
    run = len(DTYPES)
    for rank in range(2):
        for step, (out, rows) in zip(steps[rank], results[rank][run], strict=True):
            assert out.shape == step[0].shape and rows == step[0].shape[0]
            torch.testing.assert_close(out, expected(*step), rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][run][0][0], results[1][run][0][0])  # the ranks agree
    # X first or last among the same six tokens, bit for bit
    assert torch.equal(results[0][run][0][0][0], results[0][run][1][0][-1])
