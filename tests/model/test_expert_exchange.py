"""The expert exchanges over gloo, two processes, with row-wise stand-in experts (each output row depends only on
its input row, ids and weights, so any difference comes from the exchange): every token gets the ranks' partial
sums of its k weighted expert outputs, added in rank order; a token's output is bit-for-bit the same whichever
tokens share its step and whichever rank it sits on, and the same from the all-to-all and the all-gather
exchanges; a token travels once per rank holding its experts (all-to-all) or once to every rank, padded to the
capacity (all-gather); ranks with no tokens (one or all) take part; the fixed-capacity all-gather issues one
collective per dispatch and one per combine, and refuses a step above its capacity."""

from __future__ import annotations

import pytest
import torch
from _parallel_ranks import spawn_gloo

from pdserve.model.errors import ConfigError
from pdserve.model.expert_exchange import (
    ALL_GATHER_MAX_EP,
    AllGatherExchange,
    AllReduceExchange,
    AllToAllExchange,
    make_exchange,
)
from pdserve.model.parallel import ParallelLayout, WorkerLayout

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

NUM_EXPERTS, TOP_K, DIM = 8, 3, 16
CAPACITY = 8
"""Tokens per rank of the fixed-capacity all-gather runs: above every step's count (at most 6)."""


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


def make(kind: str, rank: int, world: int):
    """The exchange `kind` names, on `rank` of `world` expert-parallel ranks."""
    attention = "tensor" if kind == "all_reduce" else "data"
    layout = ParallelLayout(WorkerLayout(world, attention, expert_parallel=world), rank=rank)
    if kind == "all_reduce":
        return AllReduceExchange(layout, NUM_EXPERTS)
    if kind == "all_to_all":
        return AllToAllExchange(layout, NUM_EXPERTS)
    capacity = None if kind in ("all_gather_per_step", "all_gather_step_tokens") else CAPACITY
    combine_by = "reduce_scatter" if kind == "all_gather_reduce_scatter" else "all_to_all"
    return AllGatherExchange(layout, NUM_EXPERTS, capacity, combine_by)


def count_collectives(fn, *args):
    """fn(*args) and the number of collectives it issued, from the profiler's record of gloo's work."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn(*args)
    return result, sum(1 for e in prof.events() if e.name.startswith("gloo:"))


def _exchange_rank(rank, world, runs):
    """runs: (kind, steps) pairs, steps[rank] this rank's (x, ids, weights) per step; per run and step, the
    combined output, the rows this rank's experts computed and the collectives dispatch and combine issued."""
    outputs = []
    for kind, steps in runs:
        exchange = make(kind, rank, world)
        first = rank * exchange.experts_per_rank
        per_rank = exchange.experts_per_rank
        outputs.append([])
        for s, (x, ids, weights) in enumerate(steps[rank]):
            if kind == "all_gather_step_tokens":  # as a worker's plan tells each rank
                exchange.step_tokens = max(len(steps[r][s][0]) for r in range(world))
            (local, handle), num_dispatch = count_collectives(exchange.dispatch, x, ids, weights)
            # every row received has at least one expert here (all_to_all sends only there)
            here = (local.topk_ids < per_rank).any(1)
            assert kind != "all_to_all" or bool(here.all())
            y = local_experts(local.x, local.topk_ids, local.topk_weights, first, per_rank)
            out, num_combine = count_collectives(exchange.combine, y, handle)
            outputs[-1].append((out, local.num_rows, (num_dispatch, num_combine)))
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
EXCHANGE_RUNS = [(kind, dtype) for kind in ("all_to_all", "all_gather") for dtype in DTYPES] + [
    ("all_gather_per_step", torch.bfloat16),
    ("all_gather_step_tokens", torch.bfloat16),
    ("all_gather_reduce_scatter", torch.bfloat16),
]
"""The runs of tokens on different ranks, each over `all_to_all_steps(dtype)`; the all-reduce run follows."""


def fp8_dispatch_steps():
    """Rank 0 five tokens, rank 1 none."""
    return [make_tokens(11, 5, torch.bfloat16), make_tokens(12, 0, torch.bfloat16)]


def _two_rank_module(rank, world, runs, fp8_steps):
    """The two-rank runs of this module in one pair of processes: `_exchange_rank`'s, then
    `_dispatch_fp8_rank`'s."""
    return _exchange_rank(rank, world, runs), _dispatch_fp8_rank(rank, world, fp8_steps)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    runs = [(kind, all_to_all_steps(dtype)) for kind, dtype in EXCHANGE_RUNS]
    runs.append(("all_reduce", all_reduce_steps()))
    args = (runs, fp8_dispatch_steps())
    return spawn_gloo(tmp_path_factory.mktemp("exchange"), _two_rank_module, [args] * 2)


@pytest.fixture(scope="module")
def results(two_rank_results):
    """Per rank, `_exchange_rank`'s outputs."""
    return [exchange for exchange, _ in two_rank_results]


def owner_ranks(ids: torch.Tensor) -> int:
    """Sum over tokens of the ranks holding at least one of its experts."""
    per_rank = NUM_EXPERTS // 2
    return sum(len(set((row // per_rank).tolist())) for row in ids)


@pytest.mark.parametrize(
    "run", range(len(EXCHANGE_RUNS)), ids=[f"{k}-{d}" for k, d in EXCHANGE_RUNS]
)
def test_exchange_of_different_tokens(results, run):
    kind, dtype = EXCHANGE_RUNS[run]
    steps = all_to_all_steps(dtype)
    for rank in range(2):
        for step, (out, _, _) in zip(steps[rank], results[rank][run], strict=True):
            assert out.shape == step[0].shape and out.dtype == dtype
            assert torch.equal(out, expected(*step))
    # X alone on rank 1 equals X among five companions on rank 0, bit for bit
    assert torch.equal(results[1][run][1][0][0], results[0][run][0][0][0])
    for s in range(len(steps[0])):
        rows = sum(results[rank][run][s][1] for rank in range(2))
        if kind == "all_to_all":
            # a token travels once to each rank holding one of its experts, not once per expert
            assert rows == sum(owner_ranks(steps[rank][s][1]) for rank in range(2))
        elif kind in ("all_gather_per_step", "all_gather_step_tokens"):
            # every rank gets every rank's tokens, padded to the step's largest rank
            assert rows == 2 * 2 * max(len(steps[rank][s][0]) for rank in range(2))
        else:
            assert rows == 2 * 2 * CAPACITY
    collectives = {results[rank][run][s][2] for rank in range(2) for s in range(len(steps[0]))}
    if kind in ("all_gather", "all_gather_reduce_scatter", "all_gather_step_tokens"):
        assert collectives == {(1, 1)}  # no count exchange: the data all-gather, the combine
    elif kind == "all_gather_per_step":
        assert collectives == {(2, 1)}  # the counts, then the data
    else:
        assert collectives == {(2, 1)}  # the counts, then ids + weights + x in one message


def test_all_gather_and_all_to_all_give_the_same_bits(results):
    runs = {kind_dtype: i for i, kind_dtype in enumerate(EXCHANGE_RUNS)}
    for dtype in DTYPES:
        a2a, ag = runs[("all_to_all", dtype)], runs[("all_gather", dtype)]
        for rank in range(2):
            for got, want in zip(results[rank][ag], results[rank][a2a], strict=True):
                assert torch.equal(got[0], want[0])


def test_all_reduce_exchange(results):
    steps = all_reduce_steps()
    run = len(EXCHANGE_RUNS)
    for rank in range(2):
        for step, (out, rows, _) in zip(steps[rank], results[rank][run], strict=True):
            assert out.shape == step[0].shape and rows == step[0].shape[0]
            torch.testing.assert_close(out, expected(*step), rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][run][0][0], results[1][run][0][0])  # the ranks agree
    # X first or last among the same six tokens, bit for bit
    assert torch.equal(results[0][run][0][0][0], results[0][run][1][0][-1])


def test_all_gather_refuses_more_tokens_than_its_capacity():
    exchange = make("all_gather", 0, 2)
    x, ids, weights = make_tokens(5, CAPACITY + 1, torch.float32)
    # raised before any collective: this rank's count alone decides
    with pytest.raises(ConfigError, match=f"9 tokens on rank 0 exceed .* capacity of {CAPACITY}"):
        exchange.dispatch(x, ids, weights)
    with pytest.raises(ConfigError, match="capacity=0"):
        AllGatherExchange(exchange.layout, NUM_EXPERTS, 0)
    exchange.step_tokens = 3  # the step said at most 3 tokens a rank
    with pytest.raises(ConfigError, match="9 tokens on rank 0, more than the 3 the step said"):
        exchange.dispatch(x, ids, weights)


@pytest.mark.parametrize(
    ("worker", "options", "want"),
    [
        (WorkerLayout(2, "data"), {}, type(None)),
        (WorkerLayout(2, "tensor", 2), {}, AllReduceExchange),
        (WorkerLayout(2, "data", 2), {}, AllGatherExchange),
        (WorkerLayout(2, "data", 2), {"exchange": "all_to_all"}, AllToAllExchange),
        (WorkerLayout(2, "data", 2), {"max_tokens_per_rank": 64}, AllGatherExchange),
        (WorkerLayout(16, "data", 16), {}, AllToAllExchange),
        (WorkerLayout(16, "data", 16), {"exchange": "all_gather"}, AllGatherExchange),
    ],
)
def test_make_exchange_picks_by_layout(worker, options, want):
    layout = ParallelLayout(worker, **options)
    exchange = make_exchange(layout, 32)
    assert type(exchange) is want
    if isinstance(exchange, AllGatherExchange):
        assert exchange.capacity == layout.max_tokens_per_rank
    assert ALL_GATHER_MAX_EP < 16  # the 16-rank rows above are the all-to-all side of 'auto'


def test_layout_rejects_bad_exchange_values():
    with pytest.raises(ConfigError, match="exchange='ring'"):
        ParallelLayout(WorkerLayout(2), exchange="ring")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_tokens_per_rank=0"):
        ParallelLayout(WorkerLayout(2), max_tokens_per_rank=0)


def four_rank_steps(dtype):
    """Step 0: token X first on rank 0 among two others, rank 1 idle, ranks 2 and 3 a few tokens; step 1: X
    alone on rank 3, the others idle."""
    x_tok, empty = make_tokens(1, 1, dtype), make_tokens(4, 0, dtype)
    a, b, c = make_tokens(5, 2, dtype), make_tokens(6, 4, dtype), make_tokens(7, 1, dtype)
    return [[cat(x_tok, a), empty], [empty, empty], [b, empty], [c, x_tok]]


def test_four_ranks_add_in_rank_order(tmp_path):
    """At four ranks the partials of a token are added in rank order whichever rank it sits on, by both
    exchanges (a ring reduce-scatter would not promise that)."""
    runs = [(kind, four_rank_steps(torch.bfloat16)) for kind in ("all_to_all", "all_gather")]
    results = spawn_gloo(tmp_path, _exchange_rank, [(runs,)] * 4)
    steps = runs[0][1]
    for run in range(2):
        for rank in range(4):
            for s, (step, (out, _, _)) in enumerate(
                zip(steps[rank], results[rank][run], strict=True)
            ):
                assert torch.equal(out, expected(*step, world=4))
                assert torch.equal(out, results[rank][0][s][0])  # the all-to-all's bits
        assert torch.equal(results[3][run][1][0][0], results[0][run][0][0][0])


def _dispatch_fp8_rank(rank, world, steps):
    """Per exchange kind, with the rows sent quantized and in bf16: what this rank's experts get."""
    from pdserve.kernels.fp8_quant import quantize_act

    x, ids, weights = steps[rank]
    got = {}
    for kind in ("all_gather", "all_to_all"):
        for fp8 in (True, False):
            worker = WorkerLayout(world, "data", expert_parallel=world)
            layout = ParallelLayout(worker, rank=rank, dispatch_fp8=fp8)
            if kind == "all_gather":
                exchange = AllGatherExchange(layout, NUM_EXPERTS, CAPACITY)
            else:
                exchange = AllToAllExchange(layout, NUM_EXPERTS)
            local, _ = exchange.dispatch(x, ids, weights, quantize_act(x))
            got[kind, fp8] = (local.x, local.x_q, local.topk_ids, local.topk_weights)
    return got


def test_fp8_dispatch_carries_the_rows_quantized(two_rank_results):
    """Rows quantized for fp8 experts travel so (no bf16 copy): each rank's experts get exactly the bytes and
    scales that quantizing the bf16 rows they would otherwise get gives, with the same ids and weights; a rank
    with no tokens sends the same kind of message."""
    from pdserve.kernels.fp8_quant import quantize_act

    results = [fp8 for _, fp8 in two_rank_results]
    for rank in range(2):
        for kind in ("all_gather", "all_to_all"):
            x8, q, ids8, w8 = results[rank][kind, True]
            x16, none, ids16, w16 = results[rank][kind, False]
            assert x8 is None and none is None and x16.dtype == torch.bfloat16
            assert torch.equal(ids8, ids16) and torch.equal(w8, w16)
            real = w16.sum(1) > 0  # padding rows carry no weight
            assert int(real.sum()) > 0
            want = quantize_act(x16[real])
            assert q[0].dtype == torch.float8_e4m3fn
            assert torch.equal(q[0][real].view(torch.uint8), want[0].view(torch.uint8))
            assert torch.equal(q[1][real], want[1])
