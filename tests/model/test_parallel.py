"""Model-level parallelism on CPU over gloo, one process per rank: attention data-parallel (DP2), tensor-parallel
(TP2, dense layers and shared experts tensor-parallel too), expert-parallel MoE with the same tokens on both ranks
(EP2, attention tensor-parallel) and with different tokens (DP2 + EP2, one rank idle in the decode step; over
each expert exchange: all-gather padded per step, all-gather of fixed capacity, all-to-all) give fp32 logits
equal to the single-process path within 1e-5 relative, for a prefill and a decode step. Each expert-parallel rank
holds half the routed-expert bytes and its loader reads no other rank's expert."""

from __future__ import annotations

import re

import pytest
import torch
from _parallel_ranks import Request, run_ranks, run_steps

from pdserve.model.errors import CheckpointError, ConfigError
from pdserve.model.loader import load_model, read_checkpoint_tensors
from pdserve.model.parallel import ParallelLayout, WorkerLayout

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

WORLD = 2
PROMPT_LENS = (5, 19, 33)
NUM_PAGES = 8 * len(PROMPT_LENS)


def make_requests(vocab_size: int) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    return [
        Request(i, torch.randint(3, vocab_size, (n,), generator=g).tolist(), 3 + 7 * i)
        for i, n in enumerate(PROMPT_LENS)
    ]


@pytest.fixture(scope="module")
def tiny(checkpoint):
    return checkpoint("tiny-fp32")


@pytest.fixture(scope="module")
def reference(tiny):
    """Single-process logits of every request, all in one batch."""
    model = load_model(tiny, dtype=torch.float32, progress=False)
    assert model.args.num_attention_heads % WORLD == 0 and model.args.n_routed_experts % WORLD == 0
    requests = make_requests(model.args.vocab_size)
    return requests, run_steps(model, requests, NUM_PAGES)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


LAYOUTS = {
    "dp2": {"attention": "data"},
    "tp2": {"attention": "tensor", "dense": "tensor"},
    "ep2": {"attention": "tensor", "expert_parallel": WORLD},
    "dp2-ep2": {"attention": "data", "expert_parallel": WORLD},
    "dp2-ep2-capacity": {
        "attention": "data", "expert_parallel": WORLD, "exchange": "all_gather",
        "max_tokens_per_rank": sum(PROMPT_LENS),
    },
    "dp2-ep2-all-to-all": {"attention": "data", "expert_parallel": WORLD, "exchange": "all_to_all"},
    "dp4-ep4": {"attention": "data", "expert_parallel": 4},
    "dp4-ep4-chunked": {"attention": "data", "expert_parallel": 4, "expert_chunk_tokens": 7},
}  # fmt: skip


# dp4-ep4 on CPU is dp4-ep4-chunked's run: the same ranks, requests and exchange, whose decode step (4 rows
# a rank, under its 7-token chunk) takes the one-launch path dp4-ep4 takes, and whose prefill the chunks.
LAYOUT_CASES = [
    pytest.param(name, marks=pytest.mark.gpu_sweep) if name == "dp4-ep4" else name
    for name in LAYOUTS
]


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_layout_logits_equal_single_process(name, tiny, reference, tmp_path):
    requests, expected = reference
    layout_kwargs = LAYOUTS[name]
    if layout_kwargs.get("expert_parallel") == 4:
        # one request a rank and a rank with none (its steps only join the exchange); request 1 does not
        # decode, so two of the four ranks are idle in the decode step
        by_rank, decoding = [[requests[0]], [requests[1]], [], [requests[2]]], {0, 2}
    elif layout_kwargs["attention"] == "data":
        # different requests per rank; request 1 does not decode, so rank 1's decode step is idle
        by_rank, decoding = [[requests[0], requests[2]], [requests[1]]], {0, 2}
    else:
        by_rank, decoding = [requests, requests], {0, 1, 2}
    results = run_ranks(tmp_path, tiny, layout_kwargs, by_rank, decoding, NUM_PAGES)
    for rank, (result, mine) in enumerate(zip(results, by_rank, strict=True)):
        for step in ("prefill", "decode", "mtp"):
            got_indices = set(result["logits"][step])
            want = {r.index for r in mine if step == "prefill" or r.index in decoding}
            assert got_indices == want, f"{name} rank {rank} {step}"
            for index in want:
                err = rel_err(result["logits"][step][index], expected[step][index])
                assert err <= 1e-5, f"{name} rank {rank} {step} request {index}: {err:.2e}"
        assert result["same_as_dummy"], (
            f"{name} rank {rank}: dummy weights differ from the checkpoint's"
        )

    stored = read_checkpoint_tensors(tiny)
    expert = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
    total_expert_bytes = sum(t.nbytes for n, t in stored.items() if expert.match(n))
    ep = layout_kwargs.get("expert_parallel", 1)
    num_experts = 16
    for rank, result in enumerate(results):
        assert result["expert_bytes"] * ep == total_expert_bytes
        read_experts = {int(m.group(2)) for n, _ in result["reads"] if (m := expert.match(n))}
        per_rank = num_experts // ep
        first = rank * per_rank if ep > 1 else 0
        owned = set(range(first, first + per_rank))
        assert read_experts == owned
        names_read = [n for n, _ in result["reads"]]
        assert len(names_read) == len(set(names_read)), "a tensor was read twice"
        sliced = {n for n, kind in result["reads"] if kind == "slice"}
        if layout_kwargs["attention"] == "tensor":
            assert "model.layers.0.self_attn.o_proj.weight" in sliced
        else:
            assert not sliced


def test_layout_rejects_bad_values():
    with pytest.raises(ConfigError, match="rank=2"):
        ParallelLayout(WorkerLayout(2), rank=2)
    with pytest.raises(ConfigError, match="expert_parallel=3: must divide ranks=4"):
        WorkerLayout(4, expert_parallel=3)
    with pytest.raises(ConfigError, match="attention='heads'"):
        WorkerLayout(2, attention="heads")
    # layouts the memory plan may weigh but the ranks do not run
    with pytest.raises(ConfigError, match="expert_parallel=2: must be 1 or ranks=4"):
        ParallelLayout(WorkerLayout(4, expert_parallel=2))
    with pytest.raises(ConfigError, match="dense='tensor': needs attention='tensor'"):
        ParallelLayout(WorkerLayout(2, dense="tensor"))


def test_layout_that_does_not_divide_the_model_is_refused(tiny):
    with pytest.raises(ConfigError, match="n_routed_experts=16 does not split over 3 ranks"):
        load_model(tiny, layout=ParallelLayout(WorkerLayout(3, expert_parallel=3)))


def test_fp8_split_off_quant_blocks_is_refused(checkpoint):
    # tiny: 4 heads of 48 query dims; two ranks would each read 96 rows of an fp8 wq_b
    layout = ParallelLayout(WorkerLayout(2, "tensor"), rank=1)
    with pytest.raises(CheckpointError, match=r"q_b_proj.weight: fp8 .* rank 1 of 2"):
        load_model(checkpoint("tiny-fp8"), layout=layout)


def test_fp8_experts_dp2_ep2_dispatch_quantized_rows(checkpoint, tmp_path):
    """fp8 experts under DP2 + EP2: the rows travel quantized (`dispatch_fp8`) and the logits equal the single
    process's, which quantizes the same rows at its experts."""
    fp8 = checkpoint("tiny-fp8")
    model = load_model(fp8, dtype=torch.float32, progress=False)
    requests = make_requests(model.args.vocab_size)
    expected = run_steps(model, requests, NUM_PAGES)
    by_rank, decoding = [[requests[0], requests[2]], [requests[1]]], {0, 2}
    layout_kwargs = {"attention": "data", "expert_parallel": WORLD}
    for sent_fp8 in (True, False):
        layout_kwargs["dispatch_fp8"] = sent_fp8
        run_dir = tmp_path / f"dispatch-fp8-{sent_fp8}"
        run_dir.mkdir()
        results = run_ranks(run_dir, fp8, layout_kwargs, by_rank, decoding, NUM_PAGES)
        for rank, (result, mine) in enumerate(zip(results, by_rank, strict=True)):
            for step in ("prefill", "decode"):
                for r in mine:
                    if step == "decode" and r.index not in decoding:
                        continue
                    err = rel_err(result["logits"][step][r.index], expected[step][r.index])
                    assert err <= 1e-5, (
                        f"fp8 dispatch={sent_fp8} rank {rank} {step} {r.index}: {err:.2e}"
                    )
